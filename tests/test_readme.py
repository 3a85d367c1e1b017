"""Every Python example in the README runs, in order, as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_opens_with_the_two_setup_commands():
    first_block = re.search(r"```sh\n(.*?)```", README.read_text(), flags=re.S).group(1)
    assert first_block.splitlines()[0].startswith("make train") and "make test" in first_block.splitlines()[1]


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index, capsys):
    exec(compile(BLOCKS[index], f"README.md example {index + 1}", "exec"), {"__name__": "__readme__"})


def test_the_resume_table_says_what_resume_does():
    """Every setting a resume refuses or applies (RESUME_POLICY) sits in the README row that says so."""
    from memtrain.cli import ARGUMENT_FLAGS, ARGUMENT_SWITCHES
    from memtrain.run import RESUME_POLICY

    text = README.read_text()
    rows = {kind: next(line for line in text.splitlines() if line.startswith("| `") and f"| {kind}" in line)
            for kind in ("refused", "applied")}
    for key, policy in RESUME_POLICY.items():
        flag = ARGUMENT_FLAGS.get(key) or next((f for f in ARGUMENT_SWITCHES.get(key, ()) if f), None)
        if flag is None:
            continue  # no flag sets it (e.g. min_lr_ratio)
        flag = flag.split()[0]
        row = rows["refused" if policy == "refuse" else "applied"]
        assert f"`{flag}`" in row, (key, policy, flag)


def test_the_readme_says_to_activate_the_venv_before_its_first_bare_command():
    text = README.read_text()
    first_bare = min(text.index(f"\n{command} ") for command in ("memtrain", "python", "torchrun")
                     if f"\n{command} " in text)
    assert ". .venv/bin/activate" in text[:first_bare], "a newcomer's `memtrain` is `command not found`"


def test_the_trainer_snippet_says_bf16_is_gpu_only():
    snippet = re.search(r"```py\n(.*?)```", README.read_text(), flags=re.S).group(1)
    lines = snippet.splitlines()
    above = lines[next(i for i, line in enumerate(lines) if line.startswith("args =")) - 1]  # the comment over it
    assert "GPU" in above and "bf16=False" in above, snippet
