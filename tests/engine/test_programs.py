"""Each family's step as a program of generic ops (engine/ops.py): every op is in the
vocabulary, reads only buffers written before it, names weights its family prepares, and the
buffers and weights are what a driver can size and upload without knowing the family."""

from __future__ import annotations

import numpy as np
import pytest

from poot.engine.models import family
from poot.engine.models.synthetic import synthetic_llama, synthetic_mamba
from poot.engine.ops import PICK, VOCABULARY, Op, Program

MODELS = {"llama": synthetic_llama, "mamba": synthetic_mamba}


@pytest.mark.parametrize("name", MODELS)
def test_a_program_is_closed_over_its_buffers_and_prepared_weights(name):
    model = MODELS[name](0)
    fam = family(model.config)
    program = fam.program(model.config)
    weights = fam.prepare(model.config, model.weights, 64)
    written = set()
    for op in program.ops:
        assert op.name in VOCABULARY
        assert set(op.reads) <= written, f"{op} reads a buffer no earlier op wrote"
        assert set(op.weights) <= set(weights)
        if op.writes:
            assert op.writes in program.widths
            written.add(op.writes)
    assert program.ops[0].name == "embed" and program.ops[-1] == Op("head", ("hl",), "logits", ("lm_head",))
    assert PICK.reads == ("logits",)
    assert set(program.weight_names()) == set(weights)  # nothing prepared that no op reads
    for w in weights.values():
        assert w.dtype == np.float32 and w.flags.c_contiguous
    layers = list(range(model.config.num_layers))
    assert program.paged == (name == "llama") and program.recurrent == (name == "mamba")
    assert program.layers(frozenset({"paged_attention", "scan"})) == layers


def test_an_unknown_op_is_refused():
    with pytest.raises(ValueError, match="unknown op"):
        Op("softmax")
    assert not Program((), {}).paged and not Program((), {}).recurrent


def test_a_fused_op_stands_for_its_parts():
    from poot.engine.ops import fused

    parts = [Op("rms_norm", ("x",), "h"), Op("matmul", ("h",), "y", ("w1",)), Op("matmul_add", ("y",), "x", ("w2",))]
    op = fused("llama_layer", parts, layer=3)
    assert (op.reads, op.writes, op.weights, op.layer, op.parts) == (("x",), "x", ("w1", "w2"), 3, tuple(parts))
    program = Program((Op("embed", (), "x", ("embed",)), op), {"x": 4, "h": 4, "y": 4})
    assert program.unfused().ops == (program.ops[0], *parts)
    assert program.weight_names() == ["embed", "w1", "w2"]
    with pytest.raises(ValueError, match="takes no parts"):
        Op("rms_norm", ("x",), "h", parts=(parts[0],))
    with pytest.raises(ValueError, match="made of parts"):
        Op("llama_layer")
