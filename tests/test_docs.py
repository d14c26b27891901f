"""Every Python code block in README.md and docs/*.md runs, here on the reference
device and on the GPU under gpu-check.

A block runs alone, in a fresh namespace, as a reader who copies just that block
would run it; a block whose first line is ``# continues`` continues the previous
block (its namespace), as a reader following the page in order would."""
import re
from pathlib import Path

import pytest

from deviceop.kernels import conv

ROOT = Path(__file__).resolve().parent.parent
# docs/conv.md compiles the fused conv (seconds of NVRTC): conftest compiles it in a
# background process while the other modules run, and runs this module after them.
PRECOMPILE = [(conv.conv2d_gn_stats["float16"], conv.TILES["64x64"].generics("float16")),
              (conv.gn_act_apply[("float16", "float16")], [conv.ACTS["silu"], "__half", "__half", 3])]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"```python\n(.*?)```", re.S)
CONTINUES = "# continues"


def blocks(doc: Path) -> list[tuple[int, str]]:
    """(line number, code) of each Python block of ``doc``."""
    text = doc.read_text()
    return [(text.count("\n", 0, m.start()) + 2, m.group(1)) for m in BLOCK.finditer(text)]


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(ROOT)) for d in DOCS])
def test_doc_code_runs(doc):
    """Each block alone, or after the blocks it continues."""
    found = blocks(doc)
    assert found, f"{doc.name} has no Python code block"
    namespace = None
    for i, (line, code) in enumerate(found):
        continues = code.startswith(CONTINUES + "\n")
        assert not (continues and namespace is None), f"{doc.name}:{line}: the first block has nothing to continue"
        if not continues:
            namespace = {"__name__": "__doc_test__"}
        exec(compile(code, f"{doc.name}, Python block {i} (line {line})", "exec"), namespace)


def test_readme_has_exactly_the_ci_commands():
    text = (ROOT / "README.md").read_text()
    assert len(re.findall(r"^pip install ", text, re.M)) == 1
    assert len(re.findall(r"^python -m pytest", text, re.M)) == 1
