"""README claims: every statement about a configuration that has not run in this repository
(GPU, CUDA/NCCL, Transformer Engine, tensor parallelism, the 8-GPU launcher) says so where it
stands: in the statement itself, or in a section whose heading says "not run"."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
UNRUN = re.compile(r"GPU|gpu|CUDA|cuda|NCCL|Transformer Engine|\bTE\b|_te_|[Tt]ensor.parallel"
                   r"|\bTP\b|H20|h20")
SAYS_SO = re.compile(r"not (been )?run|not tested|no GPU", re.IGNORECASE)


def statements(text: str) -> list[tuple[str, str]]:
    """(section heading, statement): paragraphs, list items, table rows and code blocks."""
    out, heading, block, fenced = [], "", [], False

    def close():
        if block:
            out.append((heading, " ".join(block)))
            block.clear()

    for line in text.splitlines():
        if line.startswith("```"):
            block.append(line)
            if fenced:
                close()
            fenced = not fenced
        elif fenced:
            block.append(line)
        elif line.startswith("#"):
            close()
            heading = line
        elif not line.strip() or line.startswith(("- ", "|")):
            close()
            if line.strip():
                block.append(line)
                if line.startswith("|"):
                    close()
        else:
            block.append(line)
    close()
    return out


def test_statements_about_unrun_configurations_say_so():
    unmarked = [s for heading, s in statements(README.read_text())
                if UNRUN.search(s) and not SAYS_SO.search(s) and not SAYS_SO.search(heading)]
    assert not unmarked, "README statements about configurations not run here:\n" + "\n".join(
        s[:200] for s in unmarked)


def test_statement_splitting():
    text = ("## A\n\nruns on GPU\nacross lines.\n\n- a TE item, not run\n- plain\n"
            "| row | CUDA |\n\n## B (not run)\n\n```\npip install gpu\n```\n")
    assert statements(text) == [
        ("## A", "runs on GPU across lines."), ("## A", "- a TE item, not run"),
        ("## A", "- plain"), ("## A", "| row | CUDA |"),
        ("## B (not run)", "``` pip install gpu ```")]
