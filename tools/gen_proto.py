"""Regenerate the Python code of the IOP contract from ``proto/iop/v1/*.proto``.

protoc writes modules named after the proto package (``iop/v1/runtime_pb2.py``);
we place them under the installable ``iop_proto.v1`` package instead, which works
because the contract imports only protobuf's well-known types.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
DEFAULT_OUT = PROTO_ROOT / "src" / "iop_proto" / "v1"


def generate(out_dir: Path) -> list[Path]:
    """Compile every contract file into ``out_dir``; return the files written."""
    from grpc_tools import protoc  # grpcio-tools is only the compiler, never a runtime

    sources = sorted((PROTO_ROOT / "iop" / "v1").glob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"-I{include}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            *(str(s.relative_to(PROTO_ROOT)) for s in sources),
        ]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        for produced in sorted((Path(tmp) / "iop" / "v1").iterdir()):
            target = out_dir / produced.name
            shutil.copyfile(produced, target)
            written.append(target)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(f"wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
