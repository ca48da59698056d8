"""Lines of Python B and W run, per stage shape: where a shape falls off the fast paths.

B and W have fast paths for the common case (one walk to plan B, B calling a
region's node itself, W deciding a region's commits at once) and general
steps for everything else. A stage shape that falls off a fast path costs
many more lines of Python around the graphs, which on a host-bound stage is
time. This counts, per shape, the lines of Python one B and one W run outside
the compiled graphs' own code (as ``host_overhead --lines`` does for the
tiny bench stage), and beside them one ordinary backward through the same
region (``torch.autograd.backward``), after three warm-up microbatches, on a small
LayerNorm-Linear-GELU-Linear block with a residual:

    python -m benchmarks.stage_shapes                      # every shape, Inductor
    python -m benchmarks.stage_shapes --shapes base,first_stage --compiler eager
    python -m benchmarks.stage_shapes --out benchmarks/results/cpu-stage-shapes.json
    python -m benchmarks.stage_shapes --shapes none --transformers mistral,qwen3moe

``--transformers ARCH,...`` counts, besides, code fxsplit did not write: two
decoder layers of a ``transformers`` model (random init, a small config, no
download; ``inputs_embeds`` in, the last hidden state out) as a middle stage
compiled whole, with ``.grad`` empty and accumulating (:data:`TRANSFORMERS`).

Shapes: ``base``; ``frozen`` (a weight that needs no gradient, given to B and
W); ``unused`` (a parameter the forward never uses); ``tied`` (one Linear used
twice); ``two_inputs`` (a second input that needs no gradient); ``two_outputs``
(the hidden state and a scalar); ``view_output``; ``graph_break`` (two
regions); ``first_stage`` (the input needs no gradient); ``accumulating``
(``.grad`` already set: a microbatch after the step's first). The direct call
(``fxsplit.config.direct_b``) is on for every device, as on a GPU. Counts do
not move with the machine; they do with torch's version (AOTAutograd's own
wrappers are counted too, as in an ordinary backward).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

import fxsplit
from benchmarks.host_overhead import _lines_run
from fxsplit.bench.settings import provenance

D = 16


class Block(nn.Module):
    def __init__(self, shape: str) -> None:
        super().__init__()
        self.shape = shape
        self.ln = nn.LayerNorm(D)
        self.a = nn.Linear(D, D)
        self.b = nn.Linear(D, D)
        if shape == "frozen":
            self.a.bias.requires_grad_(False)
        if shape == "unused":
            self.unused = nn.Parameter(torch.zeros(D))

    def _body(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(self.ln(x))
        if self.shape == "graph_break":
            torch._dynamo.graph_break()
        last = self.a if self.shape == "tied" else self.b
        return x + last(F.gelu(h))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> Any:
        h = self._body(x)
        if mask is not None:
            h = h * mask
        if self.shape == "two_outputs":
            return h, h.pow(2).mean()
        if self.shape == "view_output":
            return h.view(-1, D)
        return h


# Microbatches before the one counted: a compiled graph's third call is the first
# that skips the CompiledFxGraph wrapper (fxsplit.runtime: _callable).
WARM_UP = 3

SHAPES = ("base", "frozen", "unused", "tied", "two_inputs", "two_outputs", "view_output", "graph_break",
          "first_stage", "accumulating")


def _counted(fn: Callable[..., Any], params: list[torch.Tensor], microbatch: Callable[[], tuple[torch.Tensor, ...]],
             accumulating: bool) -> dict[str, Any]:
    """Lines of Python (in all) of one B and one W on the compiled ``fn`` and of
    one ordinary backward through it, after :data:`WARM_UP` microbatches of
    each (``microbatch()``: the inputs of one; ``.grad`` set to ``None``
    before each unless ``accumulating``)."""

    def step(measure: bool | str) -> tuple[int, int] | None:
        if not accumulating:
            for p in params:
                p.grad = None
        args = microbatch()
        out = fn(*args)
        outs = list(out) if isinstance(out, tuple) else [out]
        grads = [torch.randn_like(o) if o.dim() else torch.ones_like(o) for o in outs]
        if measure == "ordinary":
            (lines, _), _ = _lines_run(lambda: torch.autograd.backward(outs, grads))
            return lines, 0
        b: Callable[[], Any] = lambda: fxsplit.stage_backward_input(outs, grads, list(args), params)  # noqa: E731
        if not measure:
            _, work = b()
            fxsplit.stage_backward_weight(params, work)
            return None
        (b_lines, _), (_, work) = _lines_run(b)
        (w_lines, _), _ = _lines_run(lambda: fxsplit.stage_backward_weight(params, work))
        return b_lines, w_lines

    with fxsplit.config.patch(direct_b=True):
        for _ in range(WARM_UP):
            step(False)
            step("ordinary")
        measured = step(True)
        ordinary = step("ordinary")
    assert measured is not None and ordinary is not None
    return {"b_lines": measured[0], "w_lines": measured[1], "ordinary_lines": ordinary[0],
            "b_plus_w_over_ordinary": round((measured[0] + measured[1]) / ordinary[0], 3)}


def count(shape: str, compiler: str) -> dict[str, Any]:
    """Lines of Python (in all) of one B and one W on ``shape``, and the regions' direct calls."""
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = Block(shape)
    fn = torch.compile(model, backend=fxsplit.backend(compiler=compiler, fallback="error"))
    before = fxsplit.compiled_regions()

    def microbatch() -> tuple[torch.Tensor, ...]:
        x = torch.randn(4, 8, D, requires_grad=shape != "first_stage")
        return (x, torch.randn(4, 8, D)) if shape == "two_inputs" else (x,)

    result = _counted(fn, list(model.parameters()), microbatch, shape == "accumulating")
    regions = [r for r in fxsplit.compiled_regions() if all(r is not b for b in before)]
    return {**result, "regions": len(regions), "direct_b_runs": sum(r.direct_b_runs for r in regions)}


def _transformers_kwargs(**extra: Any) -> dict[str, Any]:
    kw = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=64)
    return {**kw, **extra}


# Two decoder layers each, width 32: dense (Mistral, Phi-3, GPT-NeoX with biases, Gemma 3 with a
# sliding-window and a full-attention layer, GLM-4, BLOOM with ALiBi) and MoE (Qwen3-MoE,
# DeepSeek-V3, Phi-MoE, ERNIE-4.5-MoE and Hunyuan-MoE through transformers' grouped-mm op and
# fxsplit's shipped split rule, GPT-OSS with its own expert matmuls).
TRANSFORMERS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "mistral": ("MistralModel", "MistralConfig", _transformers_kwargs(num_key_value_heads=2)),
    "phi3": ("Phi3Model", "Phi3Config", _transformers_kwargs(num_key_value_heads=2, pad_token_id=0)),
    "gptneox": ("GPTNeoXModel", "GPTNeoXConfig", _transformers_kwargs()),
    "qwen3moe": ("Qwen3MoeModel", "Qwen3MoeConfig", _transformers_kwargs(
        num_key_value_heads=2, head_dim=8, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2)),
    "deepseekv3": ("DeepseekV3Model", "DeepseekV3Config", _transformers_kwargs(
        num_key_value_heads=4, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
        topk_group=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=8)),
    "gptoss": ("GptOssModel", "GptOssConfig", _transformers_kwargs(
        num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2)),
    "gemma3": ("Gemma3TextModel", "Gemma3TextConfig", _transformers_kwargs(
        num_key_value_heads=2, head_dim=8, sliding_window=4, layer_types=["sliding_attention", "full_attention"])),
    "glm4": ("Glm4Model", "Glm4Config", _transformers_kwargs(num_key_value_heads=2, head_dim=8, pad_token_id=0)),
    "bloom": ("BloomModel", "BloomConfig", _transformers_kwargs()),
    "phimoe": ("PhimoeModel", "PhimoeConfig", _transformers_kwargs(
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)),
    "ernie45moe": ("Ernie4_5_MoeModel", "Ernie4_5_MoeConfig", _transformers_kwargs(
        num_key_value_heads=2, moe_intermediate_size=16, moe_num_experts=4, moe_k=2, moe_num_shared_experts=1)),
    "hunyuanmoe": ("HunYuanMoEV1Model", "HunYuanMoEV1Config", _transformers_kwargs(
        num_key_value_heads=2, head_dim=8, num_experts=4, moe_topk=2)),
}


class _TransformersStage(nn.Module):
    def __init__(self, arch: str) -> None:
        super().__init__()
        import transformers

        model_cls, config_cls, kwargs = TRANSFORMERS[arch]
        config = getattr(transformers, config_cls)(**kwargs)
        config._attn_implementation = "eager"
        self.model = getattr(transformers, model_cls)(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(inputs_embeds=x).last_hidden_state


def count_transformers(arch: str, compiler: str, accumulating: bool) -> dict[str, Any]:
    """:func:`count` for two layers of transformers' ``arch`` (:data:`TRANSFORMERS`)."""
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = _TransformersStage(arch)
    fn = torch.compile(model, backend=fxsplit.backend(compiler=compiler, fallback="error"))
    params = list(model.parameters())
    width = TRANSFORMERS[arch][2]["hidden_size"]
    result = _counted(fn, params, lambda: (torch.randn(2, 8, width, requires_grad=True),), accumulating)
    return {**result, "weights": len(params)}


def main(argv: list[str] | None = None) -> dict[str, dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of: {', '.join(SHAPES)}")
    p.add_argument("--compiler", default="inductor", choices=("inductor", "eager"),
                   help="the graphs' compiler (eager: FX graphs as they are; W's commits may differ: "
                        "their gradients' layouts are not Inductor's)")
    p.add_argument("--transformers", default="", metavar="ARCH,...",
                   help=f"also two layers of these transformers models (needs transformers), of: {', '.join(TRANSFORMERS)}")
    p.add_argument("--out", type=Path, help="also write the counts as JSON (with the command and code revision)")
    args = p.parse_args(argv)
    shapes = [] if args.shapes == "none" else args.shapes.split(",")
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        p.error(f"unknown shape(s) {unknown}; known: {', '.join(SHAPES)} (or none)")
    archs = [a for a in args.transformers.split(",") if a]
    unknown = [a for a in archs if a not in TRANSFORMERS]
    if unknown:
        p.error(f"unknown transformers model(s) {unknown}; known: {', '.join(TRANSFORMERS)}")
    torch.set_num_threads(1)
    print(f"{args.compiler}, torch {torch.__version__}; lines of Python outside the graphs, one B and one W "
          "(the direct call on):")
    result: dict[str, dict[str, Any]] = {}
    for shape in shapes:
        r = result[shape] = count(shape, args.compiler)
        print(f"  {shape:13s} B {r['b_lines']:5d}  W {r['w_lines']:5d}  ordinary {r['ordinary_lines']:5d}  "
              f"(B + W) / ordinary {r['b_plus_w_over_ordinary']:5.2f}  regions {r['regions']}  "
              f"direct calls {r['direct_b_runs']}", flush=True)
    for arch in archs:
        for accumulating in (False, True):
            name = f"transformers:{arch}" + (":accumulating" if accumulating else "")
            r = result[name] = count_transformers(arch, args.compiler, accumulating)
            print(f"  {name:36s} B {r['b_lines']:5d}  W {r['w_lines']:5d}  ordinary {r['ordinary_lines']:5d}  "
                  f"(B + W) / ordinary {r['b_plus_w_over_ordinary']:5.2f}  weights {r['weights']}", flush=True)
    if args.out is not None:
        command = " ".join(["python -m benchmarks.stage_shapes", *(sys.argv[1:] if argv is None else argv)])
        doc = {"what": "lines of Python outside the compiled graphs, one B and one W after three warm-up microbatches",
               "compiler": args.compiler, "device": "cpu (line counts do not depend on the machine)",
               "shapes": result, **provenance(command)}
        args.out.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
    sys.exit(0)
