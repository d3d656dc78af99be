"""What crosses each pipeline stage boundary, per rule: the stage split ResidualParallelStrategy prints for a
24-layer model and the bytes each stage sends per microbatch (counts, not times: deterministic on any machine).

    python benchmarks/pipeline_bytes.py [--layers 24] [--C 128] [--T 16] [--stages 4] [--out FILE]

The nanoGPT of ``lightning_resctl/compare/nanogpt.py`` (``--layers`` blocks of width ``--C``, fp32, 4 heads, vocab
64), ``--stages`` gloo processes on CPU (Lightning starts them), ``pipeline_parallel_size=--stages``, 1F1B, as many
microbatches of one row of ``--T`` tokens. For every registered rule (``add``: the plain residual) one training step
with the strategy's own ``method=``; rank zero writes the strategy's line for ``mgr-competitive`` (the split) and a
table: bytes per microbatch at each boundary, split into the stream and the rule's state, and per token. ``--out``:
the markdown file (default: print only).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lightning_resctl import ResidualParallelStrategy, get_merge_rule, merge_rules  # noqa: E402
from lightning_resctl.compare.nanogpt import NanoGPT  # noqa: E402

VOCAB = 64


class GPT(L.LightningModule):
    def __init__(self, layers: int, C: int, T: int, rows: int):
        super().__init__()
        torch.manual_seed(0)
        self.model = NanoGPT(vocab_size=VOCAB, block_size=T, n_layer=layers, n_head=4, n_embd=C)
        self.rows, self.T = rows, T
        self.example_input_array = torch.zeros(1, T, dtype=torch.long)

    def forward(self, x):
        return self.model(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x).flatten(0, 1), y.flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        tokens = torch.randint(0, VOCAB, (self.rows, self.T + 1), generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=self.rows)


def one_rule(method: str, args: argparse.Namespace) -> tuple:
    options = {"backend": "torch-eager"} if "backend" in get_merge_rule(method).option_names() else {}
    strategy = ResidualParallelStrategy(method, pipeline_parallel_size=args.stages, schedule="1f1b",
                                        microbatches=args.stages, **options)
    trainer = L.Trainer(accelerator="cpu", devices=args.stages, strategy=strategy, max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(GPT(args.layers, args.C, args.T, rows=args.stages))
    return strategy.applied, strategy.pipeline.sent, trainer.global_rank


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--C", type=int, default=128)
    parser.add_argument("--T", type=int, default=16)
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rows, said, rank = [], None, 0
    for method in [m for m in merge_rules() if m != "mgr"]:  # ("mgr" is mgr-competitive)
        applied, sent, rank = one_rule(method, args)
        said = applied if method == "mgr-competitive" else said
        cells = []
        for s in sorted(sent):
            stream = sent[s][0][3]
            state = sum(b for *_, b in sent[s][1:])
            cells.append(f"{stream + state:,} ({stream:,} + {state:,})")
        per_token = [sum(b for *_, b in sent[s]) / args.T for s in sorted(sent)]
        rows.append(f"| {method} | " + " | ".join(cells) + " | " + " / ".join(f"{b:g}" for b in per_token) + " |")
    if rank != 0:
        return
    boundaries = " | ".join(f"stage {s}->{s + 1}" for s in range(args.stages - 1))
    text = "\n".join([
        f"# Pipeline stage boundaries: {args.layers} layers, C={args.C}, {args.stages} stages",
        "",
        f"`python benchmarks/pipeline_bytes.py --layers {args.layers} --C {args.C} --T {args.T} --stages "
        f"{args.stages}` (fp32, 1F1B, {args.stages} microbatches of one row of {args.T} tokens; CPU, gloo).",
        "",
        "The strategy's line (mgr-competitive):",
        "",
        "```text",
        said,
        "```",
        "",
        "Bytes each stage sends per microbatch (stream + the rule's state), and per token at each boundary:",
        "",
        f"| rule | {boundaries} | per token |",
        "|---|" + "---|" * args.stages,
        *rows,
        "",
    ])
    print(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
