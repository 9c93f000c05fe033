"""The schemas and asks the structured-output, tools and responses clauses send, in one place:
the suite's test files and the grammar benchmark read them from here."""

from __future__ import annotations

# Every document is short whatever the model picks: an enum, bounded integers, a boolean, a
# string of at most 6 characters. Its longest compact form, escapes and all, is about 130 bytes, so
# 256 tokens hold it even at one byte a token, and a model that ends "length" there was not held
# to the schema. Strict, as OpenAI's strict mode wants: every property required, no others.
ANIMAL = {
    "type": "object",
    "properties": {
        "animal": {"type": "string", "enum": ["cat", "dog", "owl"]},
        "legs": {"type": "integer", "minimum": 0, "maximum": 8},
        "wild": {"type": "boolean"},
        "name": {"type": "string", "maxLength": 6},
    },
    "required": ["animal", "legs", "wild", "name"],
    "additionalProperties": False,
}
ANIMAL_ASK = "Describe an animal as JSON: its kind, its number of legs, whether it is wild, and a short name."

# Tool parameters kept small (an enum, a boolean), so a server that writes the tools into the
# prompt of a model with a byte-level tokenizer and 512 positions still fits prompt and call.
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Oslo", "Lima"]}}}
CLOCK = {"type": "object", "properties": {"utc": {"type": "boolean"}}}
WEATHER_ASK = "Weather in Oslo?"


# A schema slow to compile: an anyOf of SLOW_OBJECTS objects of SLOW_PROPERTIES integer
# properties each, every name carrying `tag` (so no compiled grammar of an earlier one is found
# kept). About 750 KB, under a 1 MiB body limit and below the size llguidance refuses (1,600
# objects are refused); it takes llguidance 0.65 s to compile and start on a Zen 4 core.
SLOW_OBJECTS = 1300
SLOW_PROPERTIES = 10


def slow_schema(tag: str) -> dict:
    def one(i: int) -> dict:
        names = [f"{tag}{i}_{j}" for j in range(SLOW_PROPERTIES)]
        return {"type": "object", "properties": {n: {"type": "integer"} for n in names}, "required": names,
                "additionalProperties": False}

    return {"anyOf": [one(i) for i in range(SLOW_OBJECTS)]}
