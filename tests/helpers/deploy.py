"""The repository's deployment files, parsed: the Dockerfile's stages and where manifests live."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


DOCKERFILE = ROOT / "Dockerfile"


K8S = ROOT / "deploy" / "k8s"


DOCS = ROOT / "docs" / "kubernetes.md"


@dataclass
class Stage:
    """One `FROM` stage: its instructions in order, as (INSTRUCTION, arguments) pairs."""

    name: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, instruction: str) -> list[str]:
        return [args for ins, args in self.instructions if ins == instruction]

    def last(self, instruction: str) -> str:
        found = self.all(instruction)
        assert found, f"stage {self.name!r} has no {instruction}"
        return found[-1]

    def exec_form(self, instruction: str) -> list[str]:
        """An exec-form (JSON array) ENTRYPOINT / CMD; shell form would not pass SIGTERM on."""
        args = self.last(instruction)
        argv = json.loads(args)
        assert isinstance(argv, list), f"{instruction} must be in exec form, not {args!r}"
        return argv

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """The stage's ENV, expanding `$VAR` / `${VAR}` against earlier values and `base`."""
        env = dict(base or {})
        for args in self.all("ENV"):
            for pair in shlex.split(args):
                key, _, value = pair.partition("=")
                env[key] = re.sub(r"\$\{?(\w+)\}?", lambda m: env.get(m.group(1), ""), value)
        return env


def dockerfile_stages(path: Path = DOCKERFILE) -> list[Stage]:
    """Split a Dockerfile into stages (continuations joined, comments and directives dropped)."""
    logical: list[str] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    stages: list[Stage] = []
    for line in logical:
        instruction, _, args = line.partition(" ")
        instruction, args = instruction.upper(), args.strip()
        if instruction == "FROM":
            words = args.split()
            stages.append(Stage(words[-1] if "AS" in map(str.upper, words) else str(len(stages))))
        if stages:
            stages[-1].instructions.append((instruction, args))
    return stages


def runtime_stage() -> Stage:
    return dockerfile_stages()[-1]

