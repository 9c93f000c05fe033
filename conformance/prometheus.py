"""The one reader of Prometheus text that the suite, the load tests and the tests share.

Parsing is prometheus_client's own; this module only fixes what a scrape becomes: samples
keyed by (name, labels), or, for reports that must be JSON, by one flat string per series
(`name{a="x",b="y"}`, labels sorted) that `split_key` turns back.
"""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


class MetricsFormatError(ValueError):
    """The text is not Prometheus exposition format."""


def parse(text: str) -> Samples:
    """Every sample of a scrape: (sample name, labels) -> value. A `_created` sample (the
    time a counter was made, which prometheus_client adds) is not a measurement and is left out."""
    samples: Samples = {}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name.endswith("_created"):
                    continue
                samples[(s.name, frozenset(s.labels.items()))] = float(s.value)
    except (ValueError, TypeError, IndexError) as e:
        raise MetricsFormatError(str(e)) from None
    return samples


def names(samples: Samples) -> set[str]:
    return {name for name, _ in samples}


def value(samples: Samples, name: str, **labels: str) -> float | None:
    """The sum of `name`'s samples whose labels include `labels`; None where there is none."""
    found = [v for (n, have), v in samples.items() if n == name and all(i in have for i in labels.items())]
    return sum(found) if found else None


def label(samples: Samples, name: str, key: str) -> str | None:
    """The value of label `key` on `name`'s first sample (an info metric's field)."""
    for (n, have), _ in samples.items():
        if n == name:
            return dict(have).get(key)
    return None


def key(name: str, labels: frozenset[tuple[str, str]] | dict[str, str]) -> str:
    items = sorted(dict(labels).items())
    return name + ("{" + ",".join(f'{k}="{v}"' for k, v in items) + "}" if items else "")


def flat(samples: Samples) -> dict[str, float]:
    """{key(name, labels): value}, for reports that must be JSON."""
    return {key(n, labels): v for (n, labels), v in samples.items()}


def split_key(flat_key: str) -> tuple[str, dict[str, str]]:
    """The name and labels of a flat key; the inverse of `key` (label values here never hold
    quotes or commas: they are kinds, reasons and bucket bounds)."""
    name, _, rest = flat_key.partition("{")
    labels = {}
    for part in rest.rstrip("}").split(","):
        if "=" in part:
            k, v = part.split("=", 1)
            labels[k] = v.strip('"')
    return name, labels


def parse_flat(text: str) -> dict[str, float]:
    return flat(parse(text))
