"""The block's own code, compiled: a :class:`~lightning_paradyse.graph.program.Program` runs as one Python function
that makes the interpreter's calls on the interpreter's arguments.

Every program of Hugging Face families whose code before the attention differs (q/k norms, partial rotary, norms
that mix heads, fused projections, sliding windows) and of BERT (a tail: dropout, a residual and a post-norm after
the output projection) compiles, and gives what the interpreter gives, bit for bit, in every call the rewrite's
verification makes (every mode, float64).
"""

from __future__ import annotations

import copy
import pickle
from typing import Any

import pytest
import torch

from lightning_paradyse.graph import program as program_module
from lightning_paradyse.graph.dispatch import AttentionDispatch, MlpDispatch
from lightning_paradyse.graph.program import Program
from lightning_paradyse.runtime.parallel import dispatchers, parallelize
from tests.support.families import BertLM, hf_family

pytest.importorskip("transformers")

FAMILIES = ("qwen3", "phi", "olmo2", "gpt2", "neox", "gemma3")


def _programs(model: torch.nn.Module) -> list[Program]:
    found = []
    for _, op in dispatchers(model):
        if isinstance(op, (AttentionDispatch, MlpDispatch)):
            found += [code for code in (getattr(op.roles, "program", None), op.roles.tail) if code is not None]
    return found


@pytest.mark.parametrize("kind", [*FAMILIES, "bert"])
def test_programs_compile_and_match_the_interpreter(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    def both(self: Program, inputs: Any, values: Any, owner: Any) -> tuple[Any, ...]:
        made = self.__dict__["_compiled"]
        assert made is not None, "the program fell back to the interpreter"
        assert (len(inputs), len(values)) == (self.n_inputs, self.n_values)  # run() takes the compiled function
        compiled = made(self, inputs, values, owner)
        interpreted = self.interpret(inputs, values, owner)
        assert len(compiled) == len(interpreted)
        for a, b in zip(compiled, interpreted):
            assert type(a) is type(b) and (not isinstance(a, torch.Tensor) or torch.equal(a, b))
        calls.append(1)
        return compiled

    monkeypatch.setattr(Program, "run", both)
    torch.manual_seed(0)
    model = (BertLM() if kind == "bert" else hf_family(kind)).double()
    parallelize(model, None)  # verifies every rewritten op in every mode, running its programs
    assert calls and all(program_module._compile(code) is not None for code in _programs(model))


def test_a_program_is_pickled_and_copied_without_its_compiled_form_and_compiled_again() -> None:
    """The compiled function is made with the program and again where a copy is made (a pickle, a deep copy: what
    the spawn launcher and ``compile=True`` do), never on a first call (which may be inside a ``torch.compile``
    trace, where making it went wrong)."""
    torch.manual_seed(0)
    model = hf_family("qwen3").double()
    parallelize(model, None)
    code = _programs(model)[0]
    assert "_compiled" not in code.__getstate__()
    for made in (pickle.loads(pickle.dumps(code)), copy.deepcopy(code)):
        assert made.steps == code.steps and made.__dict__["_compiled"] not in (None, code.__dict__["_compiled"])
