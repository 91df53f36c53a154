"""The guide's text, without root: every command in it is one the multihost test runs.

Plain ``make test`` runs these (they need no namespace), so a shell block added to
docs/deploy-bare-metal.md without a test tag, or a step the test no longer finds, fails
here, before anyone needs root to notice.
"""

from __future__ import annotations

import re

from guide import GUIDE, parse

STEPS = (
    "first",
    "first-completion",
    "worker",
    "add-node",
    "models",
    "retire",
    "retire-cleanup",
    "reissue",
)


def test_every_shell_block_of_the_guide_is_tagged_for_the_test() -> None:
    text = GUIDE.read_text()
    fences = re.findall(r"^```(?:sh|bash)$", text, re.M)
    blocks, variables = parse(text)
    assert len(fences) == len(blocks) + 1  # and the vars block
    assert variables == ["HOST1", "HOST2", "HOST3"]


def test_the_steps_the_test_runs_are_in_the_guide_in_order() -> None:
    blocks, _ = parse(GUIDE.read_text())
    seen = list(dict.fromkeys(block.step for block in blocks))
    assert seen == list(STEPS)


def test_only_the_install_block_is_left_out() -> None:
    blocks, _ = parse(GUIDE.read_text())
    skipped = [block for block in blocks if block.mode == "no"]
    assert len(skipped) == 1
    assert all(
        "pip install" in c.text or "useradd" in c.text or "venv" in c.text
        for c in skipped[0].commands
    )
