"""Chat templates shipped with Bullet, for models whose own template has no tools: `--chat-template
chatml-tools` (ChatML models, such as the embedded SmolLM2; calls in <tool_call> tags) or
`llama3-tools` (Llama 3 header tokens; calls as bare JSON). Any other value of `--chat-template` is
a path to a Jinja file. Both templates were written for this project (Apache-2.0, as the project)."""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent
SHIPPED = {p.stem: p for p in sorted(HERE.glob("*.jinja"))}


def read_template(name_or_path: str) -> str:
    """The template text for a shipped name or a file path; ValueError saying what is wrong."""
    if name_or_path in SHIPPED:
        return SHIPPED[name_or_path].read_text()
    path = Path(name_or_path).expanduser()
    if not path.is_file():
        raise ValueError(f"--chat-template {name_or_path!r} is neither a shipped template "
                         f"({', '.join(SHIPPED)}) nor a file")
    text = path.read_text()
    if not text.strip():
        raise ValueError(f"--chat-template {name_or_path}: the file is empty")
    return text
