"""The committed generated code matches what `make proto` would write now."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "proto" / "src" / "iop_proto" / "v1"


def test_committed_generated_code_is_current(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gen_proto.py"), "--out", str(tmp_path)],
        check=True,
        capture_output=True,
    )
    fresh = sorted(p.name for p in tmp_path.iterdir())
    assert fresh == ["runtime_pb2.py", "runtime_pb2.pyi"]
    for name in fresh:
        assert (tmp_path / name).read_bytes() == (COMMITTED / name).read_bytes(), (
            f"{name} is stale: run `make proto` and commit the result"
        )
