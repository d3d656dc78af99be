"""Coverage sweeps: patch_residuals on every model of a zoo, each checked the same way.

    python benchmarks/coverage.py --library hf        # every family the installed transformers registers
    python benchmarks/coverage.py --library litgpt    # every entry of litgpt.config.configs
    python benchmarks/coverage.py --library timm      # one model per timm architecture module (the smallest)
    python benchmarks/coverage.py --library hf --only falcon,bloom,gpt2 --out -
    python benchmarks/coverage.py --library timm --limit 10 --timeout-per-model 60

Each model is built small with random init (nothing downloaded; see benchmarks/coverage_*.py) and
checked: builds, patches, merge count against the structural expectation, "add" bitwise, unpatch bitwise, one
training step of "rescontroller" and "mgr" with finite values. Prints the table and a one-line summary; writes
the library's section of docs/coverage.md (the other sections are kept) and the summary at its top.
"""
from __future__ import annotations

import argparse
import logging
import os
import platform
import re
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.coverage_hf import BACKEND, markdown_table, summary_line  # noqa: E402

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "coverage.md")
ORDER = ("hf", "litgpt", "timm")


# ---------------------------------------------------------------------------------------------- libraries
class Library:
    """What the script needs of one zoo: its models, how to run one, and how to describe the results."""

    key = ""
    title = ""
    noun = "models"
    first = "model"
    second = "class"
    default_timeout = 60.0

    def version(self) -> str:
        raise NotImplementedError

    def names(self) -> dict:
        """name -> what to build (ordered)."""
        raise NotImplementedError

    def run(self, name: str, what, timeout: float):
        raise NotImplementedError

    method = ""


class HF(Library):
    key, title, noun, first, second = "hf", "Hugging Face transformers", "families", "family", "class"

    def version(self):
        import transformers

        try:
            from transformers.utils import logging as hf_logging

            hf_logging.set_verbosity_error()
        except ImportError:
            pass
        logging.getLogger("transformers").setLevel(logging.ERROR)
        return f"transformers {transformers.__version__}"

    def names(self):
        from benchmarks.coverage_hf import families

        return families()

    def run(self, name, what, timeout):
        from benchmarks.coverage_hf import run_family

        return run_family(name, what, timeout=timeout)

    method = """\
Each family (a `model_type` of `transformers`) is built with the task head listed first in
`MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES`, `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`,
`MODEL_FOR_MASKED_LM_MAPPING_NAMES`, `MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES`, else `MODEL_MAPPING_NAMES`,
from its default config shrunk automatically (at most 2 layers, width 32, 2 heads, feed-forward 64,
vocabulary 128, one block per vision stage, dropout 0; random init, nothing downloaded), and run on random
token ids (2 x 8) or images; families whose input is neither (audio, multimodal processors) or whose config
cannot be shrunk are skipped with the reason. The structural expectation is derived from the config alone:
2 merges per layer (attention + MLP) for a model with a plain layer count; 2 per encoder layer + 3 per decoder
layer (self-attention, cross-attention, MLP) for an encoder-decoder; 1 per layer for a parallel block (a config
flag such as `use_parallel_residual`/`parallel_attn`, or an architecture known to add its two branches to the
stream in one block: `PARALLEL_FAMILIES` in `benchmarks/coverage_hf.py`) or a state-space mixer;
2 per attention block of vision stages (plus one per residual group and one around the body for
`RESIDUAL_GROUP_FAMILIES`); `?`: no plain layer count (convolutional stages, hybrids).
"""


class LitGPT(Library):
    key, title, noun, first, second = "litgpt", "LitGPT", "configs", "config", "model"

    def version(self):
        from importlib.metadata import version

        return f"litgpt {version('litgpt')}"

    def names(self):
        from benchmarks.coverage_litgpt import config_names

        return {n: None for n in config_names()}

    def run(self, name, what, timeout):
        from benchmarks.coverage_litgpt import run_config

        return run_config(name, timeout=timeout)

    method = """\
Each entry of `litgpt.config.configs` is built as `litgpt.model.GPT` from its config shrunk (2 layers, width
32, 2 heads of 16 — one key/value group where the config groups queries — feed-forward 64, 4 experts with at
most 2 per token, vocabulary 128; random init, nothing downloaded) and run on random token ids (2 x 8). The
structural expectation is read from LitGPT's `Block`: 2 merges per layer (`x = attention_output + x`, then
`mlp(x_normed) + x`); with `parallel_residual=True` both branches read the block's input and the block is one
merge of its input and attention + MLP (docs/surgery.md, "Parallel blocks"): 1 per layer. The model column
gives the MLP class and `parallel` for parallel blocks.
"""


class Timm(Library):
    key, title, noun, first, second = "timm", "timm", "architectures", "module", "model"
    default_timeout = 120.0

    def version(self):
        from benchmarks.timm_import import import_timm

        return f"timm {import_timm().__version__}"

    def names(self):
        from benchmarks.coverage_timm import architectures

        return architectures()

    def run(self, name, what, timeout):
        from benchmarks.coverage_timm import run_architecture

        return run_architecture(name, what, timeout=timeout)

    method = """\
One model per timm architecture module (`timm.list_modules()`): the one with the fewest parameters among the
module's models (counted on the meta device) — or, where every block of that one projects its shortcut, the
smallest whose blocks include an identity residual (`MODELS` in `benchmarks/coverage_timm.py`) —
built with `pretrained=False` (random init, nothing downloaded), with `depth=2` where the constructor takes it,
and run on 2 random images of the smallest size it accepts among 32, 56, 64, 96, 112, 128 pixels (passed as
`img_size` where the model takes it), else its default input size. timm is imported without torchvision through
`import_timm()` of `benchmarks/timm_import.py` (docs/install.md). The structural expectation is read from
the model's blocks during one forward (`expected_merges` in `benchmarks/coverage_timm.py`): timm
puts a stochastic-depth slot on each residual branch (`drop_path`, `drop_path1`, `attn_drop_path`...), so each
call of a slot is one merge; a block whose shortcut is a projection (a `downsample`/`shortcut`/`skip` module
that is not an identity) has one merge fewer per call, a block that adds no shortcut (`has_skip=False`,
`no_skip=True`, `shortcut=None`...) none; residual modules outside that convention (convolutional position
encodings, ConvNeXt-V2's response norm, Inception-ResNet's blocks, NASNet's identity cell branch, a learned
scale on the stream, ...) count what their entry in `BLOCKS` says, each read from the module's `forward`;
dense, plain and Inception architectures (`NO_RESIDUAL`) have none. A layer-scale product is part of its
branch, not a merge. `exact (no residual)`: the structure has no merge and none was found.
"""


LIBRARIES = {lib.key: lib for lib in (HF(), LitGPT(), Timm())}


# ---------------------------------------------------------------------------------------------- the document
_HEAD = """\
# Coverage of `patch_residuals` over model zoos

Each section is written by `python benchmarks/coverage.py --library NAME` (the other sections are kept): every
model of the zoo built small with random init (nothing downloaded), patched and checked the same way. Columns
of every table:

- *builds*: the model builds and runs a forward (else skipped, with the reason);
- *merges / expected*: merges `patch_residuals(method="add")` found, against the structural expectation (how it
  is derived: each section);
- *add bitwise* / *unpatch bitwise*: output of the `add`-patched model, and of the model after
  `unpatch_residuals`, equal to the unpatched output bit for bit (same seed for every forward);
- *rescontroller* / *mgr*: a freshly patched model (backend `{backend}`) trains one SGD step with finite loss,
  gradients and output (`-`: MGR refused, e.g. a weight-shared layer runs several chains);
- *status*: `exact` = expected count + bitwise add + bitwise unpatch (+ both rules train); `exact (no
  residual)` = the structure has no merge and none was found; `patched (no expectation)` = bitwise, count not
  checked; `exact (rule failed)`, `failed` / `skipped`: see the reason.

""".format(backend=BACKEND)


def _section(lib: Library, results: list, line: str, cmd: str, version: str, elapsed: float, threads: int,
             not_tried: list, max_minutes: float) -> str:
    failing = [r for r in results if r.builds and not r.exact and r.status != "patched (no expectation)"]
    out = [f"<!-- coverage:{lib.key} -->", f"## {lib.title}", "",
           f"Generated by `{cmd}` ({version}, torch {torch.__version__}, Python {platform.python_version()}, "
           f"{threads} thread(s)); sweep time {elapsed:.0f} s.", "", f"**{line}**", "", lib.method.rstrip()]
    if not_tried:
        out += ["", f"Not tried (time budget of {max_minutes:g} min): {', '.join(not_tried)}."]
    if failing:
        out += ["", f"### {lib.title}: built but not patched exactly", ""]
        out += [f"- **{r.family}** ({r.cls}): {r.status}: {r.reason or 'see table'}" for r in failing]
    out += ["", f"### {lib.title}: all {lib.noun}", "", markdown_table(results, lib.first, lib.second),
            f"<!-- /coverage:{lib.key} -->"]
    return "\n".join(out) + "\n"


def write_section(path: str, key: str, section: str) -> None:
    """Replace (or add, in ORDER) the section of ``key`` in the document at ``path``; rebuild the summary."""
    text = open(path).read() if os.path.exists(path) else ""
    sections = {k: m.group(0) + "\n" for k, m in
                ((k, re.search(rf"<!-- coverage:{k} -->.*?<!-- /coverage:{k} -->", text, flags=re.S)) for k in ORDER)
                if m}
    sections[key] = section
    summary = ["**Summary.**", ""]
    for k in ORDER:
        if k in sections:
            line = re.search(r"^\*\*(\d+ \S+ tried.*)\*\*$", sections[k], flags=re.M)
            made = re.search(r"\(([a-z]+ [^,]+), torch", sections[k])
            summary.append(f"- {LIBRARIES[k].title} ({made.group(1) if made else '?'}): "
                           f"{line.group(1) if line else '?'}")
    body = _HEAD + "\n".join(summary) + "\n\n" + "\n".join(sections[k] for k in ORDER if k in sections)
    with open(path, "w") as f:
        f.write(body)


# ---------------------------------------------------------------------------------------------- main
def _command(given: list) -> str:
    """The command line as run, without ``--out``."""
    words, skip = [], False
    for word in given:
        if skip:
            skip = False
        elif word == "--out":
            skip = True
        elif not word.startswith("--out="):
            words.append(word)
    return " ".join(["python benchmarks/coverage.py", *words])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--library", choices=sorted(LIBRARIES), required=True, help="the zoo to sweep")
    ap.add_argument("--only", default="", help="comma-separated names (HF model_type, LitGPT config name, timm "
                                               "module; default: all)")
    ap.add_argument("--limit", type=int, default=None, help="try at most this many")
    ap.add_argument("--timeout-per-model", type=float, default=None,
                    help="seconds per model (default 60; 120 for timm)")
    ap.add_argument("--max-minutes", type=float, default=40.0,
                    help="stop trying new models after this many minutes (default 40)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--out", default=DOC, help="markdown file whose section is written ('-' for none)")
    args = ap.parse_args(argv)
    lib = LIBRARIES[args.library]
    timeout = args.timeout_per_model or lib.default_timeout

    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    version = lib.version()
    t0 = time.perf_counter()
    zoo = lib.names()
    names = [f.strip() for f in args.only.split(",") if f.strip()] or list(zoo)
    unknown = [n for n in names if n not in zoo]
    if unknown:
        ap.error(f"unknown {lib.noun} {unknown} ({len(zoo)} known)")
    if args.limit is not None:
        names = names[: args.limit]

    results, not_tried = [], []
    for i, name in enumerate(names):
        if time.perf_counter() - t0 > 60 * args.max_minutes:
            not_tried = names[i:]
            break
        r = lib.run(name, zoo[name], timeout)
        results.append(r)
        print(f"[{i + 1}/{len(names)}] {name:28s} {r.status:26s} "
              f"{'-' if r.merges is None else r.merges}/{'?' if r.expected is None else r.expected} "
              f"{r.seconds:5.1f}s {r.reason[:110]}", flush=True)
    elapsed = time.perf_counter() - t0
    table = markdown_table(results, lib.first, lib.second)
    line = summary_line(results, lib.noun)
    print()
    print(table)
    print()
    print(line)
    print(f"sweep time: {elapsed:.0f} s ({len(results)} {lib.noun}, {args.threads} thread(s))"
          + (f"; {len(not_tried)} not tried (time budget)" if not_tried else ""))

    if args.out != "-":
        cmd = _command(argv if argv is not None else sys.argv[1:])
        write_section(args.out, lib.key, _section(lib, results, line, cmd, version, elapsed, args.threads,
                                                  not_tried, args.max_minutes))
        print(f"wrote the {lib.key} section of {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
