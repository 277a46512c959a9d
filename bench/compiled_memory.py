"""What a compiled training step keeps for backward, LIMe against LLaMA, at the paper's 1B shapes
(the recipes ``lime-1b-gqa`` and ``lime-1b-mha``).

Under ``torch.compile`` AOT autograd splits the step into a forward and a backward graph; the forward's
extra outputs are the tensors backward reads, and together they make the activation memory at the
step's peak. This counts them (distinct storages, in bytes; parameters and inputs excluded: both models
keep theirs) from the partitioned graphs of a model built on the meta device in bf16, so it needs no
GPU and no memory: shapes only, exact. LIMe's routed reads should add their K/V buffer (every layer's
raw keys and values once, ``2 * L * kv * B * T * head_dim`` elements) and nothing else.

On the meta device attention takes PyTorch's math path, which keeps each layer's attention
probabilities (a GPU's flash kernel keeps only its statistics): the same in both models, so the
difference is exact, but the totals are larger than a GPU's.

    python bench/compiled_memory.py
    python bench/compiled_memory.py --routings full first-4 dilated-8 --batch 1
"""

from __future__ import annotations

import argparse

import torch

from lime_model import LimeForCausalLM
from lime_model.command_line import POSITIVE_INT, OneLineParser
from lime_model.plan import stand_in_tokenizer
from lime_model.recipes import load_recipe
from lime_model.train import model_config

MiB = 2**20


def saved_for_backward(model: torch.nn.Module, ids: torch.Tensor, backward: bool = True) -> int:
    """Bytes of the distinct storages the compiled forward of ``model`` on ``ids`` saves for backward
    (not parameters or inputs), from AOT autograd's partitioned graphs (run as ATen ops); ``backward``
    also runs the step's backward."""
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._functorch.aot_autograd import aot_module_simplified

    graphs = {}

    def backend(gm, inputs):
        def forward(graph, _):
            graphs["forward"] = graph
            return make_boxed_func(graph.forward)

        return aot_module_simplified(
            gm, inputs, fw_compiler=forward, bw_compiler=lambda graph, _: make_boxed_func(graph.forward),
            partition_fn=min_cut_rematerialization_partition,
        )  # fmt: skip

    torch._dynamo.reset()
    logits = torch.compile(model, backend=backend, fullgraph=True)(ids, use_cache=False).logits
    if backward:
        logits.float().sum().backward()
    nodes = list(graphs["forward"].graph.nodes)
    placeholders = {n for n in nodes if n.op == "placeholder"}
    storages = {}
    for node in nodes[-1].args[0][1:]:  # after the logits
        value = node.meta.get("val")
        if node not in placeholders and isinstance(value, torch.Tensor):
            storages[id(value.untyped_storage())] = value.untyped_storage().nbytes()
    return sum(storages.values())


def build(args: argparse.Namespace, shape: str, routing: str) -> LimeForCausalLM:
    """``lime-1b-<shape>``'s model with ``routing`` ("none": LLaMA) and ``--layers``, as ``lime-model
    plan`` builds it, on the meta device in bf16."""
    recipe = load_recipe(f"lime-1b-{shape}", {"routing": routing, "model.num_hidden_layers": args.layers})
    with torch.device("meta"):
        return LimeForCausalLM(model_config(recipe, stand_in_tokenizer(recipe))).to(torch.bfloat16).train()


def main() -> None:
    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--routings", nargs="+", default=["full"], help="LIMe routing specs beside LLaMA")
    parser.add_argument("--layers", type=POSITIVE_INT, default=16)
    parser.add_argument("--batch", type=POSITIVE_INT, default=4)
    parser.add_argument("--seq", type=POSITIVE_INT, default=2048)
    args = parser.parse_args()
    ids = torch.zeros(args.batch, args.seq, dtype=torch.long, device="meta")
    print(
        f"saved for backward by one compiled step, bf16, {args.batch} x {args.seq} tokens, {args.layers} layers"
    )
    print(f"{'shape':<5} {'model':<15} {'MiB':>10} {'- LLaMA':>9} {'buffer':>9} {'x LLaMA':>8}")
    try:  # a bad routing spec, before any tracing
        models = {
            (shape, r): build(args, shape, r) for shape in ("gqa", "mha") for r in ("none", *args.routings)
        }
    except ValueError as err:
        raise SystemExit(f"compiled_memory.py: {err}") from None
    for shape in ("gqa", "mha"):
        model = models[shape, "none"]
        llama = saved_for_backward(model, ids, backward=False)
        print(f"{shape:<5} {'LLaMA':<15} {llama / MiB:10.3f}")
        config = model.config  # keys and values, every layer, bf16
        buffer = 2 * args.layers * config.num_key_value_heads * ids.numel() * config.head_dim * 2
        for routing in args.routings:
            lime = saved_for_backward(models[shape, routing], ids, backward=False)
            print(
                f"{shape:<5} {'LIMe ' + routing:<15} {lime / MiB:10.3f} {(lime - llama) / MiB:9.3f} "
                f"{buffer / MiB:9.3f} {lime / llama:8.4f}"
            )


if __name__ == "__main__":
    main()
