"""Move engine/server/'s modules into its three concerns, and rewrite every reference to them.

  engine/server/api/           the HTTP front end (FastAPI app, request fields, replies, limits)
  engine/server/vllm_adapter/  ``--engine vllm``'s side of the API process and its startup
  engine/server/process/       the process boundary (engine process and client, pool, wire)

Idempotent: a module already moved is skipped, and a reference already rewritten no longer
matches, so it can run again on a tree where a merged branch still edits or imports a module at
its old path (git's rename detection carries the edit across; this rewrites the imports)::

    python scripts/server_moves.py          # moves + rewrites, then `ruff --select I --fix`
    python scripts/server_moves.py --check  # lists what it would change, changes nothing

Module names stay the same: only the folder changes. A moved module that finds the repository
from its own path (``Path(__file__).parents[N]``) is one folder deeper: check such lines by hand
(vllm_adapter/vllm_spec.py's ROOT was the one).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SERVER = ROOT / "engine" / "server"

PACKAGES: dict[str, tuple[str, list[str]]] = {
    "api": ("The HTTP front end: the FastAPI app, request fields and their limits, replies.", [
        "admin_routes", "app", "connections", "fetch_slots", "forwarded", "front_door",
        "logprobs", "metrics", "prepare", "protocol", "reply", "request_fields", "request_ids",
        "respond", "sequence_admission", "structured_fields", "tenants", "text_limits",
        "token_counts", "tool_fields", "tool_parsers",
    ]),
    "vllm_adapter": ("``--engine vllm``: its requests' inputs and media, its engine's "
                     "arguments and startup.", [
        "vllm_inputs", "vllm_media", "vllm_process", "vllm_spec", "vllm_startup",
    ]),
    "process": ("The process boundary: the engine process, its client and pool, the wire "
                "between them.", [
        "cache_reset", "engine_client", "engine_pool", "engine_proc", "outbox",
        "parallel_defaults", "shared_inputs", "wire",
    ]),
}
WHERE = {module: package for package, (_, modules) in PACKAGES.items() for module in modules}

SUFFIXES = {".py", ".toml", ".md", ".cfg", ".ini", ".txt", ".yml", ".yaml"}
NAMES = "|".join(sorted(WHERE, key=len, reverse=True))
DOTTED = re.compile(rf"\bengine\.server\.({NAMES})(?![\w])")
SLASHED = re.compile(rf"\bengine/server/({NAMES})(?=\.py\b|/|\b)(?![\w])")
NAME = r"\w+(?:\s+as\s+\w+)?"
FROM = re.compile(rf"^([ \t]*)from engine\.server import (\(\s*{NAME}(?:\s*,\s*{NAME})*\s*,?\s*\)"
                  rf"|{NAME}(?:[ \t]*,[ \t]*{NAME})*)", re.M)


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True,
                          text=True).stdout


def rewrite_from(match: re.Match[str]) -> str:
    indent, names = match.group(1), match.group(2).strip("()")
    groups: dict[str, list[str]] = {}
    for name in (n.strip() for n in names.split(",")):
        if name:
            module = name.split()[0]
            groups.setdefault(WHERE.get(module, ""), []).append(name)
    if set(groups) == {""}:
        return match.group(0)
    lines = [f"{indent}from engine.server{'.' + package if package else ''} import "
             f"{', '.join(sorted(found))}" for package, found in sorted(groups.items())]
    return "\n".join(lines)


def rewrite(text: str) -> str:
    text = FROM.sub(rewrite_from, text)
    text = DOTTED.sub(lambda m: f"engine.server.{WHERE[m.group(1)]}.{m.group(1)}", text)
    return SLASHED.sub(lambda m: f"engine/server/{WHERE[m.group(1)]}/{m.group(1)}", text)


def main(check: bool) -> int:
    changed: list[str] = []
    for package, (doc, modules) in PACKAGES.items():
        folder = SERVER / package
        init = folder / "__init__.py"
        if not init.exists():
            changed.append(str(init.relative_to(ROOT)))
            if not check:
                folder.mkdir(exist_ok=True)
                init.write_text(f'"""{doc}"""\n')
                git("add", str(init))
        for module in modules:
            old = SERVER / f"{module}.py"
            new = folder / f"{module}.py"
            if old.exists() and new.exists():  # a merge left both: which to keep is a person's
                changed.append(f"BOTH {old.relative_to(ROOT)} and {new.relative_to(ROOT)}: "
                               "merge the old one's changes into the new by hand, delete it")
            elif old.exists():
                changed.append(f"{old.relative_to(ROOT)} -> {package}/{module}.py")
                if not check:
                    git("mv", str(old), str(new))
    this = Path(__file__).resolve()
    rewritten: list[Path] = []
    for name in git("ls-files", "-co", "--exclude-standard").splitlines():
        path = ROOT / name
        if path.resolve() == this or not path.is_file():
            continue
        if path.suffix not in SUFFIXES and path.name != ".importlinter":
            continue
        text = path.read_text(encoding="utf-8", errors="surrogateescape")
        new = rewrite(text)
        if new != text:
            changed.append(f"rewrite {name}")
            rewritten.append(path)
            if not check:
                path.write_text(new, encoding="utf-8", errors="surrogateescape")
    ruff = ROOT / ".venv" / "bin" / "ruff"
    python = [str(p) for p in rewritten if p.suffix == ".py"]
    if python and not check and ruff.exists():
        subprocess.run([str(ruff), "check", "-q", "--select", "I", "--fix", *python], cwd=ROOT)
    print("\n".join(changed) or "nothing to move or rewrite")
    return 0


if __name__ == "__main__":
    sys.exit(main("--check" in sys.argv[1:]))
