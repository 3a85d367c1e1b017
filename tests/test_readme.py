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
