"""The side-by-side serving benchmark (`poot-load serving`, poot.loadtests.serving):
its figures on recorded data, a whole run against two throwaway SSE servers, and a short run
against the bundled server on the synthetic model. Structure and plausibility only: speed is
what the benchmark prints, never what a test asserts."""

import json

import pytest

from poot.loadtests import closed_loop, peers, scrape, serving, step_metrics
from poot.loadtests.cli import main as poot_load
from poot.loadtests.client import discover_model
from poot.loadtests.english import SENTENCES, prompt_set
from poot.loadtests.server_proc import BundledServer

from .fakeserver import FakeServer


def _rec(i, kind, t_sent, chunks, status="ok", tokens=None, prompt=40):
    return {"i": i, "k": i, "kind": kind, "prompt_index": i, "t_sent": t_sent, "chunks": chunks,
            "end": (chunks[-1] + 0.001) if chunks else 0.0, "status": status, "error": None,
            "completion_tokens": len(chunks) if tokens is None and status == "ok" else tokens,
            "prompt_tokens": prompt if status == "ok" else None, "cached_tokens": 0}


def test_prompts_are_distinct_english_and_seeded():
    a, b = prompt_set(0), prompt_set(1)
    assert len(a) == len(set(a)) == 64 and a == prompt_set(0) and a != b
    assert all(any(s.startswith(p[:40]) for s in SENTENCES) for p in a)  # each opens a sentence
    assert len({p[:30] for p in a}) == 64  # ... a sentence of its own
    lengths = [len(p) for p in prompt_set(0, chars_per_token=1.0)]  # in characters: the targets
    assert 10 <= min(lengths) and max(lengths) <= 186


@pytest.mark.realmodel
def test_prompt_lengths_in_smollm2_tokens():
    """With the request tag the benchmark adds, seed 0's prompts are 28 to 189 SmolLM2 tokens."""
    from poot.engine.models import load_model

    model = load_model(None)
    for i, p in enumerate(prompt_set(0)):
        for k in (i, i + 64 * 1500):  # the shortest and a five-digit tag
            n = len(model.encode_prompt(f"Request {k}. {p}"))
            assert 28 <= n <= 189, (k, n)


def test_bucket_quantile_interpolates_and_clamps():
    buckets = [(0.001, 0.0), (0.01, 50.0), (0.1, 100.0), (float("inf"), 100.0)]
    assert step_metrics.bucket_quantile(buckets, 0.5) == pytest.approx(0.01)
    assert step_metrics.bucket_quantile(buckets, 0.75) == pytest.approx(0.055)
    assert step_metrics.bucket_quantile(buckets, 0.99, largest=0.05) == 0.05
    assert step_metrics.bucket_quantile([(1.0, 0.0), (float("inf"), 0.0)], 0.5) is None


def test_level_summary_counts_the_measured_window():
    # C = 2: two warm-ups, three measured, one cool-down hung up on; a token every 10 ms.
    ticks = [0.01 * j for j in range(1, 11)]
    records = [_rec(0, "warmup", 0.0, ticks), _rec(1, "warmup", 0.0, ticks),
               _rec(2, "measured", 0.11, ticks), _rec(3, "measured", 0.11, ticks),
               _rec(4, "measured", 0.22, ticks[:9] + [0.2]),
               _rec(5, "cooldown", 0.22, ticks[:5], status="cancelled")]
    s = closed_loop.level_summary(records, closed_loop.LevelPlan(2, 2, 3, max_tokens=10))
    assert s["requests"] == {"measured": 3, "ok": 3, "warmup": 2, "cooldown": 1, "cancelled": 1}
    assert s["errors"] == 0 and s["output_tokens"]["short"] == 0 and s["output_tokens"]["tokens_per_chunk"] == 1
    # Window: 0.11 .. 0.421, the three measured streams and the cool-down's five chunks; the
    # warm-ups ended before it.
    assert s["window_s"] == pytest.approx(0.311)
    assert s["window_tokens"] == 30 + 5
    assert s["ttft"]["count"] == 3 and s["ttft"]["p50"] == pytest.approx(0.01)
    assert s["itl"]["count"] == 27 and s["itl"]["p50"] == pytest.approx(0.01)
    assert s["itl"]["max"] == pytest.approx(0.11)
    g = s["gap_ratio"]
    assert g["streams"] == 3 and g["worst"] == pytest.approx(11.0) and g["median"] == pytest.approx(1.0)
    assert s["prompt_tokens"]["min"] == 40


def test_prompt_tokens_and_goodput_over_the_measured_window():
    # Window 0.11 .. 0.421 as above. Prompts whose first token came in it: the three measured
    # (40 each) and the cool-down, hung up on without usage (prompt 5's length taken from
    # request 1's usage of the same prompt index); the warm-ups' first tokens came before.
    ticks = [0.01 * j for j in range(1, 11)]
    records = [_rec(0, "warmup", 0.0, ticks), _rec(1, "warmup", 0.0, ticks, prompt=50),
               _rec(2, "measured", 0.11, ticks), _rec(3, "measured", 0.11, [2.0, 2.01]),
               _rec(4, "measured", 0.22, ticks[:9] + [0.2]),
               _rec(5, "cooldown", 0.22, ticks[:5], status="cancelled")]
    records[5]["prompt_index"] = 1
    records[3]["chunks"] = [0.05, 0.3]  # TTFT 50 ms, one gap of 250 ms
    s = closed_loop.level_summary(records, closed_loop.LevelPlan(2, 2, 3, max_tokens=10),
                                  closed_loop.Goodput(ttft_s=0.02, itl_s=0.02))
    assert s["prompt_window_tokens"] == 40 + 40 + 40 + 50
    assert s["prompt_tok_s"] == pytest.approx(170 / s["window_s"])
    # Request 2 meets both; 3 misses TTFT (and its gap); 4's mean gap is (0.2 - 0.01) / 9 > 20 ms.
    g = s["goodput"]
    assert (g["met"], g["of"]) == (1, 3) and g["req_s"] == pytest.approx(1 / s["window_s"])
    assert closed_loop.level_summary(records, closed_loop.LevelPlan(2, 2, 3, max_tokens=10),
                                     closed_loop.Goodput(ttft_s=1.0, itl_s=1.0))["goodput"]["met"] == 3


def test_goodput_targets_parse_and_refuse_nonsense():
    assert closed_loop.Goodput.parse("ttft=2500,itl=150") == closed_loop.Goodput(2.5, 0.15)
    assert closed_loop.Goodput.parse("itl=100") == closed_loop.Goodput(itl_s=0.1)
    assert closed_loop.Goodput.parse("") == closed_loop.Goodput()
    for bad in ("ttft", "tpot=5", "ttft=fast", "itl=0", "itl=-3"):
        with pytest.raises(ValueError, match="--goodput"):
            closed_loop.Goodput.parse(bad)


def test_the_long_mix_draws_prompts_of_its_lengths_and_bad_ranges_are_refused():
    long = prompt_set(0, 8, 1200, 1400, chars_per_token=1.0)  # in characters: the targets
    assert all(1190 <= len(p) <= 1400 for p in long)
    with pytest.raises(ValueError, match="prompt lengths"):
        prompt_set(0, 8, 1400, 1200)
    with pytest.raises(ValueError, match="high <="):
        prompt_set(0, 8, 1200, 100_000)
    for args in (["--prompt-tokens", "lots"], ["--prompt-tokens", "900-100"], ["--goodput", "ttft=x"]):
        assert serving.main(["--server", "a=http://127.0.0.1:9", *args]) == 2, args
    with pytest.raises(SystemExit):
        serving.main(["--mix", "huge"])


def test_metrics_delta_reads_step_histogram_and_compiles():
    b = {"engine_compiles": 11.0, 'engine_step_duration_seconds_count{kind="decode"}': 10.0,
         'engine_step_duration_seconds_sum{kind="decode"}': 0.1,
         'engine_step_duration_seconds_bucket{kind="decode",le="0.01"}': 10.0,
         'engine_step_duration_seconds_bucket{kind="decode",le="+Inf"}': 10.0,
         'engine_step_duration_max_seconds{kind="decode"}': 0.009, "engine_steps_total": 10.0}
    a = dict(b, **{'engine_step_duration_seconds_count{kind="decode"}': 20.0,
                   'engine_step_duration_seconds_sum{kind="decode"}': 0.3,
                   'engine_step_duration_seconds_bucket{kind="decode",le="+Inf"}': 20.0,
                   'engine_step_duration_max_seconds{kind="decode"}': 0.05, "engine_steps_total": 20.0})
    d = step_metrics.metrics_delta(b, a)
    st = d["steps"]["decode"]
    assert st["count"] == 10 and st["mean_s"] == pytest.approx(0.02) and st["max_grew"] is True
    assert st["p99_s"] <= 0.05 and d["compiles"] == {"before": 11.0, "after": 11.0}
    assert d["totals"]["engine_steps_total"] == 10
    assert step_metrics.metrics_delta(None, a) == {"available": False}


def test_llama_slots_have_room_for_the_mix(monkeypatch):
    """llama.cpp splits -c over its slots and refuses a request longer than a slot's share:
    the long mix (1,400-token prompts) needs 2048 a slot where the chat mix fits in 1024."""
    assert peers.slot_context(392) == 1024 and peers.slot_context(1798) == 2048
    monkeypatch.setattr(peers, "llama_server_binary", lambda: "/opt/llama-server")
    monkeypatch.setattr(peers, "vllm_setup", lambda: ("/opt/python", "/opt/smollm2"))
    targets = peers.default_targets([4, 16], gguf="/m/llama-1b.gguf", request_tokens=1798)
    assert [t.name for t in targets] == ["poot", "llama"], "vLLM has no folder of this GGUF's weights"
    assert "-m /m/llama-1b.gguf" in targets[1].command and f"-c {2048 * 32}" in targets[1].command
    targets = peers.default_targets([4, 16], gguf="/m/llama-1b.gguf", request_tokens=1798, vllm_model="/m/llama-1b-hf")
    assert [t.name for t in targets] == ["poot", "llama", "vllm"]
    assert "--model /m/llama-1b-hf " in targets[2].command and "--dtype bfloat16" in targets[2].command
    assert "--served-model-name" not in targets[2].command  # the folder's own name, as /v1/models says
    smollm2 = peers.default_targets([1, 8])[-1]
    assert "--model /opt/smollm2 " in smollm2.command and "--dtype float32" in smollm2.command
    assert "--served-model-name SmolLM2-135M-Instruct" in smollm2.command


def test_vllm_model_needs_a_gguf_and_a_folder(tmp_path, capsys):
    assert serving.main(["--vllm-model", str(tmp_path)]) == 2
    assert "--serve-model FILE.gguf" in capsys.readouterr().err
    assert serving.main(["--serve-model", "/m/x.gguf", "--vllm-model", str(tmp_path)]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_server_options():
    t = peers.parse_targets(["a=my-server --port {port}", "b=http://127.0.0.1:9/"])
    assert t[0].command and t[1].url == "http://127.0.0.1:9"
    peers.apply_bodies(t, ['b={"cache_prompt": false}'])
    assert t[1].extra_body == {"cache_prompt": False} and t[0].extra_body is None
    for bad in (["a=my-server"], ["nourl"], ["a=http://x", "a=http://y"]):
        with pytest.raises(ValueError):
            peers.parse_targets(bad)
    with pytest.raises(ValueError):
        peers.apply_bodies(t, ['c={"x": 1}'])
    assert serving.main(["--server", "a=no-port-here"]) == 2
    poot = peers.poot_target("synthetic", "--draft ngram", key="k")
    assert poot.command.endswith("--model synthetic --host 127.0.0.1 --port {port} --draft ngram")
    assert poot.env == {"POOT_API_KEY": "k"} and peers.poot_target().env is None
    assert serving.main(["--serve", "--server", "poot=http://127.0.0.1:9"]) == 2  # two servers named poot


def _check_run(data, names, levels, max_tokens, measured):
    assert [s["name"] for s in data["servers"]] == names
    for s in data["servers"]:
        assert "error" not in s, s.get("error")
        assert [lv["concurrency"] for lv in s["levels"]] == levels
        for lv in s["levels"]:
            assert lv["errors"] == 0, lv["error_kinds"]
            assert lv["requests"]["measured"] == lv["requests"]["ok"] == measured
            assert lv["requests"]["warmup"] == lv["concurrency"]
            assert lv["output_tokens"] == {**lv["output_tokens"], "expected": max_tokens, "short": 0,
                                           "with_usage": measured, "total": measured * max_tokens}
            assert lv["out_tok_s"] > 0 and lv["window_s"] > 0 and lv["window_tokens"] >= max_tokens
            assert lv["ttft"]["count"] == measured and lv["ttft"]["min"] >= 0
            # A chunk may carry more than one token (a detokenizer holding back part of a character).
            assert measured <= lv["itl"]["count"] <= measured * (max_tokens - 1) and lv["itl"]["min"] >= 0
            assert lv["itl"]["p50"] <= lv["itl"]["p99"] <= lv["itl"]["max"]
            assert lv["prompt_tokens"]["count"] == measured and lv["prompt_tokens"]["min"] > 0
            for r in lv["records"]:
                if r["kind"] == "measured":
                    assert r["completion_tokens"] == max_tokens >= len(r["chunks"]) > 1
                    assert r["chunks"] == sorted(r["chunks"]) and r["end"] >= r["chunks"][-1]
                assert r["status"] in ("ok", "cancelled")
    assert len(data["ratios"]) == len(levels) * (len(names) - 1)
    for r in data["ratios"]:
        assert r["base"] == names[0] and r["out_tok_s"] > 0


def test_two_servers_side_by_side(tmp_path):
    with FakeServer(step_s=0.002) as a, FakeServer(step_s=0.004) as b:
        code = serving.main(["--server", f"a={a.url}", "--server", f"b={b.url}", "--extra-body",
                             'b={"cache_prompt": false}', "--concurrency", "1,2", "--requests", "3",
                             "--max-tokens", "6", "--chars-per-token", "1", "--quiet",
                             "--out", str(tmp_path / "out"), "--json", str(tmp_path / "s.json"),
                             "--markdown", str(tmp_path / "s.md")])
        assert a.state.running == b.state.running == 0
    assert code == 0
    data = json.loads((tmp_path / "s.json").read_text())
    _check_run(data, ["a", "b"], [1, 2], 6, 3)
    assert data["servers"][1]["extra_body"] == {"cache_prompt": False}
    assert len(set(data["prompt_texts"])) == 64
    md = (tmp_path / "s.md").read_text()
    assert "| C | server | out tok/s | prompt tok/s | TTFT p50 | E2E p50 | ITL p50 / p99 / max |" in md
    for lv in data["servers"][0]["levels"]:  # every measured request's prompt arrived in the window
        assert lv["prompt_window_tokens"] >= sum(r["prompt_tokens"] for r in lv["records"] if r["kind"] == "measured")
        assert lv["goodput"]["of"] == lv["requests"]["measured"]
    assert all(not s.get("rss_healthy_bytes") for s in data["servers"]), "URLs: no process to read"
    assert md.count("| a / b |") == 2 and "### Per server and level" in md


@pytest.mark.slow
def test_against_the_bundled_server(tmp_path):
    """poot-serve --model synthetic started from its command, beside a fake peer by URL."""
    with FakeServer(step_s=0.002) as peer:
        code = serving.main(["--server", "poot=poot-serve --model synthetic --port {port}",
                             "--server", f"peer={peer.url}", "--concurrency", "1,2", "--requests", "3",
                             "--max-tokens", "8", "--chars-per-token", "1", "--quiet", "--logs", str(tmp_path),
                             "--out", str(tmp_path / "out"),
                             "--json", str(tmp_path / "s.json")])
    assert code == 0
    data = json.loads((tmp_path / "s.json").read_text())
    _check_run(data, ["poot", "peer"], [1, 2], 8, 3)
    poot = data["servers"][0]
    assert poot["kind"] == "poot" and poot["exit_code"] is not None and poot["model"].startswith("synthetic")
    for lv in poot["levels"]:
        m = lv["metrics"]
        assert set(m["steps"]) == {"decode", "mixed", "prefill"}
        assert m["steps"]["decode"]["count"] > 0 and m["steps"]["decode"]["mean_s"] > 0
        assert m["compiles"]["after"] >= m["compiles"]["before"] > 0
        assert m["totals"]["generation_tokens_total"] >= lv["output_tokens"]["total"]
        assert lv["cached_tokens"] == 0  # the request tag keeps the prefix cache out of it
        assert lv["quiet_before"]["ok"] is True
        assert lv["rss_peak_bytes"] >= 10 << 20  # a Python server's resident set, read from /proc
    assert poot["rss_healthy_bytes"] >= 10 << 20 and "rss_healthy_bytes" not in data["servers"][1]
    assert "### Memory" in (tmp_path / "out" / "serving.md").read_text()
    assert (tmp_path / "poot.log").stat().st_size > 0


def test_poot_load_serving_sends_the_key_and_writes_its_report_folder(tmp_path, monkeypatch):
    """`poot-load serving` against a keyed bundled server: the key reaches discovery, the
    requests and the scrapes (a keyless /v1/models would be refused and the model unknown),
    and the folder holds the figures, the tables and the server's log."""
    out = tmp_path / "report"
    monkeypatch.setenv("POOT_API_KEY", "sesame")  # the server inherits it: the key is in no command line
    code = poot_load(["serving", "--server", "poot=poot-serve --model synthetic --port {port}",
                      "--api-key", "sesame", "--concurrency", "2", "--requests", "2", "--max-tokens", "6",
                      "--chars-per-token", "1", "--quiet", "--out", str(out)])
    assert code == 0
    data = json.loads((out / "serving.json").read_text())
    _check_run(data, ["poot"], [2], 6, 2)
    poot = data["servers"][0]
    assert poot["kind"] == "poot" and poot["model"].startswith("synthetic")
    assert poot["levels"][0]["metrics"]["available"] is True  # /metrics scraped with the key
    assert "sesame" not in (out / "serving.json").read_text() + (out / "serving.md").read_text()
    assert (out / "logs" / "poot.log").stat().st_size > 0


def test_poot_load_serving_serve_starts_a_keyed_bundled_server(tmp_path, monkeypatch):
    """`poot-load serving --serve` with --api-key: the poot-serve it starts requires the key
    (POOT_API_KEY in its environment, as `poot-load --serve` does), and a tiny bounded run
    against it writes its report folder. No llama-server or vLLM is found beside it here."""
    monkeypatch.setenv("LLAMA_SERVER", str(tmp_path / "no-llama-server"))
    monkeypatch.setenv("VLLM_CACHE", str(tmp_path / "no-vllm"))
    monkeypatch.delenv("VLLM_VENV", raising=False)
    monkeypatch.delenv("POOT_API_KEY", raising=False)
    out = tmp_path / "report"
    code = poot_load(["serving", "--serve", "--serve-model", "synthetic", "--api-key", "sesame",
                      "--concurrency", "1", "--requests", "2", "--warmup", "1", "--max-tokens", "4",
                      "--chars-per-token", "1", "--quiet", "--out", str(out)])
    assert code == 0
    data = json.loads((out / "serving.json").read_text())
    _check_run(data, ["poot"], [1], 4, 2)
    poot = data["servers"][0]
    assert poot["kind"] == "poot" and poot["model"].startswith("synthetic") and poot["exit_code"] is not None
    assert "sesame" not in (out / "serving.json").read_text() + (out / "serving.md").read_text()
    assert (out / "serving.md").read_text().startswith("## Serving, side by side")
    assert "Authorization" not in (out / "logs" / "poot.log").read_text()


def test_discovery_sends_the_key(tmp_path):
    """A keyed bundled server lists its models only to the key: discovery and the server's
    kind are asked with it; without it the model is unknown ("default")."""
    with BundledServer(log_path=str(tmp_path / "server.log"), api_key="sesame") as url:
        assert discover_model(url, "sesame").startswith("synthetic")
        assert discover_model(url) == "default"  # refused: 401 without the key
        assert peers.server_kind(url, "sesame")[0] == "poot"
        assert scrape.fetch(url, api_key="sesame")["engine_requests_running"] == 0
