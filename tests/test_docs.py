"""The documentation against the code it describes (fast; no process group).

- Every ``titan-dualpipe`` (or ``python -m titan_dualpipe``) command line that ``README.md``,
  ``docs/*.md`` and ``benchmarks/README.md`` show names a real sub-command, whose ``--help``
  runs (the console script's entry point, in a subprocess) and lists every option the line
  uses; a line without placeholders also parses with the real parser (values, choices,
  required arguments), and ``gpu-kit`` lines run with ``--dry-run`` (``python -m
  titan_dualpipe``).
- Every ``bootstrap.py`` line (on the pages and in the sub-commands' ``--help``) names one of
  its commands, a supported torch or torchtitan, test paths and markers that exist, and a valid
  ``titan-dualpipe`` command where it runs one.
- Every relative link in ``README.md``, ``docs/`` and ``benchmarks/`` resolves, anchors included,
  and so does every ``docs/<page>.md#<anchor>`` the code, tests, configs and CI scripts point at.
- ``docs/make_pictures.py`` draws exactly the pictures ``docs/`` holds.
- Repository paths and ``titan_dualpipe.*`` names in code spans exist.
- The dependency rule of ``docs/architecture.md`` holds on the real imports.
"""

from __future__ import annotations

import ast
import json
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "titan_dualpipe"
# Pages whose commands are checked: the README, the docs and how to run the benchmarks (the dated
# reports are snapshots: their command lines are the ones their figures came from).
COMMAND_DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]
LINKED_DOCS = sorted({*COMMAND_DOCS, *(ROOT / "benchmarks").glob("*.md")})
HELP_TIMEOUT_S = 300

FENCE = re.compile(r"^[ \t]*```([\w-]*)[^\n]*\n(.*?)^[ \t]*```", re.M | re.S)
SHELL_FENCES = {"bash", "sh", "shell", "console", ""}
SPAN = re.compile(r"`([^`]+)`")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$", re.M)
PLACEHOLDER = re.compile(r"[\[\]<>|]|\.\.\.|…|^[A-Z][A-Z0-9_]*$")
REPO_TOP = {"titan_dualpipe", "tests", "train_configs", "docs", "benchmarks", ".ci", "examples"}
SUBPACKAGES = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}


# ---- what the pages show ----------------------------------------------------------------------


@dataclass(frozen=True)
class Shown:
    """One command line (tokens after the program) as a page shows it."""

    page: str
    text: str
    args: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.page}: {self.text}"


def _shell_lines(text: str) -> list[str]:
    """Lines of the shell code blocks, continuation lines joined."""
    lines = []
    for lang, body in FENCE.findall(text):
        if lang in SHELL_FENCES:
            lines += re.sub(r"\\\n\s*", " ", body).splitlines()
    return lines


def _spans(text: str) -> list[str]:
    """Inline code spans outside code blocks (a span may wrap lines; ``a | b`` is ``a|b``)."""
    return [re.sub(r"\s*\|\s*", "|", " ".join(span.split())) for span in SPAN.findall(FENCE.sub("", text))]


def _tokens(line: str) -> list[str]:
    try:
        tokens = shlex.split(line, comments=True)
    except ValueError:  # an unbalanced quote in prose
        return []
    return tokens[: tokens.index("|")] if "|" in tokens else tokens  # a shell pipe ends the command


def _commands(path: Path, program: str) -> list[Shown]:
    """Command lines of ``program`` ("titan-dualpipe" or "bootstrap") on one page."""
    text, page = path.read_text(), str(path.relative_to(ROOT))
    shown = []
    for line in _shell_lines(text) + _spans(text):
        tokens = _tokens(line)
        for i, token in enumerate(tokens):
            if program == "titan-dualpipe":
                module = token in ("python", "python3") and tokens[i + 1:i + 3] == ["-m", "titan_dualpipe"]
                if token == "titan-dualpipe" or module:
                    shown.append(Shown(page, line.strip(), tuple(tokens[i + (3 if module else 1):])))
                    break
            elif token.endswith("titan_dualpipe/bootstrap.py"):
                shown.append(Shown(page, line.strip(), tuple(tokens[i + 1:])))
                break
    return shown


def titan_dualpipe_commands() -> list[Shown]:
    return [c for page in COMMAND_DOCS for c in _commands(page, "titan-dualpipe") if c.args]


def bootstrap_commands() -> list[Shown]:
    return [c for page in COMMAND_DOCS for c in _commands(page, "bootstrap")]


def bootstrap_commands_in_help() -> list[Shown]:
    """``bootstrap.py`` lines that the sub-commands' ``--help`` shows (e.g. ``matrix``'s)."""
    shown = []
    for path, (_, text) in help_texts().items():
        for line in text.splitlines():
            tokens = _tokens(line)
            for i, token in enumerate(tokens):
                if token.endswith("titan_dualpipe/bootstrap.py"):
                    shown.append(Shown(f"titan-dualpipe {' '.join(path)} --help", line.strip(), tuple(tokens[i + 1:])))
                    break
    return shown


def is_synopsis(args: tuple[str, ...]) -> bool:
    """A line with placeholders (``CONFIG``, ``[--json]``, ``a|b``, ``...``) shows usage, not a run."""
    return any(PLACEHOLDER.search(a) for a in args)


# ---- sub-commands and their help --------------------------------------------------------------


def subcommand_paths(args: tuple[str, ...]) -> list[tuple[str, ...]]:
    """The sub-command(s) a line names: ``("bench", "titan")``, ``("draw",)``; ``a|b`` gives both."""
    if not args:
        return []
    paths = []
    for first in args[0].split("|"):
        if first == "bench" and len(args) > 1:
            paths += [(first, kind) for kind in args[1].strip("[]").split("|")]
        else:
            paths.append((first,))
    return paths


def options_used(args: tuple[str, ...]) -> set[str]:
    """This package's options on a line: ``--x`` / ``-o`` tokens (torchtitan's dotted overrides
    and the values of ``-m``/``-k``-like arguments are not ours)."""
    found = set()
    for arg in args:
        arg = arg.strip("[]")
        name = arg.split("=", 1)[0]
        if re.fullmatch(r"--?[A-Za-z][\w-]*", name) and "." not in name:
            found.add(name)
    return found


# ``titan-dualpipe PATH --help`` for many PATHs in one subprocess: the console script's entry
# point (``titan_dualpipe.cli:main``), with its exit status and output per PATH. One interpreter
# imports torch once; a process per sub-command would cost as much again for each.
HELP_DRIVER = """
import contextlib, io, json, sys
from titan_dualpipe.cli import main
out = {}
for path in json.loads(sys.argv[1]):
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            code = main([*path, "--help"])
    except SystemExit as stop:
        code = stop.code
    out[" ".join(path)] = [code or 0, buf.getvalue()]
print(json.dumps(out))
"""


@lru_cache(maxsize=None)
def help_texts() -> dict[tuple[str, ...], tuple[int, str]]:
    """``titan-dualpipe <path> --help`` (exit status, output) of every sub-command the pages use."""
    paths = sorted({p for c in titan_dualpipe_commands() for p in subcommand_paths(c.args)})
    done = subprocess.run([sys.executable, "-c", HELP_DRIVER, json.dumps(paths)], cwd=ROOT,
                          capture_output=True, text=True, timeout=HELP_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.splitlines()[-1])
    return {tuple(key.split(" ")): (code, text) for key, (code, text) in results.items()}


def check_titan_dualpipe(args: tuple[str, ...]) -> list[str]:
    """What is wrong with one ``titan-dualpipe`` line (empty: nothing)."""
    problems = []
    paths = subcommand_paths(args)
    if not paths:
        return ["no sub-command"]
    helps = help_texts()
    for path in paths:
        rc, text = helps.get(path, (None, ""))
        if rc != 0:
            problems.append(f"`titan-dualpipe {' '.join(path)} --help` exited {rc}: {text[-500:]}")
            continue
        for option in sorted(options_used(args)):
            if not re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", text):
                problems.append(f"`titan-dualpipe {' '.join(path)}` has no option {option}")
    mention = len(args) == len(paths[0])  # "`titan-dualpipe check`" names the sub-command only
    if not problems and not mention and not is_synopsis(args):
        problems += _parse(args) + _config_exists(args)
    return problems


def _parse(args: tuple[str, ...]) -> list[str]:
    """Parse a concrete line with the real parser (argparse exits on an error)."""
    from titan_dualpipe.cli import build_parser

    try:
        build_parser().parse_args(list(args))
    except SystemExit as stop:
        return [f"the parser rejects it (exit {stop.code})"] if stop.code else []
    return []


def _config_exists(args: tuple[str, ...]) -> list[str]:
    """``train`` / ``bench titan`` CONFIG: a TOML that exists, or a function of the shipped registry."""
    rest = args[1:] if args[0] == "train" else args[2:] if args[:2] == ("bench", "titan") else None
    if not rest or rest[0].startswith("-"):
        return []
    config, module = rest[0], _option_value(args, "--module")
    if config.endswith(".toml"):
        return [] if (ROOT / config).exists() else [f"{config} does not exist"]
    if module not in (None, "titan_dualpipe.titan"):
        return []  # the user's own registry
    return [] if config in registry_configs() else [f"{config} is not a config of titan_dualpipe.titan"]


def _option_value(args: tuple[str, ...], option: str) -> str | None:
    for i, arg in enumerate(args[:-1]):
        if arg == option:
            return args[i + 1]
    return None


@lru_cache(maxsize=None)
def registry_configs() -> set[str]:
    tree = ast.parse((PACKAGE / "titan" / "config_registry.py").read_text())
    return {node.name for node in tree.body if isinstance(node, ast.FunctionDef) and not node.name.startswith("_")}


# ---- bootstrap lines --------------------------------------------------------------------------


def check_bootstrap(args: tuple[str, ...]) -> list[str]:
    from titan_dualpipe import bootstrap

    args = list(args)
    problems = []
    while args[:1] in (["--torch"], ["--torchtitan"]) and len(args) > 1:
        option, value, args = args[0], args[1], args[2:]
        if option == "--torch" and not PLACEHOLDER.search(value) and not bootstrap.in_range(value):
            problems.append(f"--torch {value} is outside {bootstrap.range_text()}")
        if option == "--torchtitan" and value not in bootstrap.TORCHTITAN:
            problems.append(f"--torchtitan {value}: bootstrap knows {sorted(bootstrap.TORCHTITAN)}")
    if not args or args[0] not in ("train", "test", "run"):
        return problems + [f"bootstrap.py has no command {args[:1]} (train, test, run)"]
    command, rest = args[0], tuple(args[1:])
    if command == "train":
        problems += check_titan_dualpipe(("train", *rest))
    elif command == "run" and rest[:2] == ("-m", "titan_dualpipe"):
        problems += check_titan_dualpipe(rest[2:])
    elif command == "test":
        problems += _check_pytest_args(rest)
    return problems


def _check_pytest_args(args: tuple[str, ...]) -> list[str]:
    problems = []
    markers = registered_markers()
    for i, arg in enumerate(args):
        if i and args[i - 1] == "-m":
            unknown = set(re.findall(r"\w+", arg)) - {"not", "and", "or"} - markers
            problems += [f"unknown pytest marker {m}" for m in sorted(unknown)]
        elif not arg.startswith("-") and not (i and args[i - 1] in ("-k", "-m")):
            problems += _missing_path(arg)
    return problems


@lru_cache(maxsize=None)
def registered_markers() -> set[str]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return {m.split(":")[0].strip() for m in config["tool"]["pytest"]["ini_options"]["markers"]}


# ---- paths and names in code spans -----------------------------------------------------------


def _missing_path(token: str) -> list[str]:
    """A repository path (``tests/x.py::test_y``, ``runtime/pairs.py``) that does not exist."""
    path, _, test = token.partition("::")
    path = path.rstrip(",.;:")
    first = path.split("/")[0]
    if PLACEHOLDER.search(path) or "*" in path or "/" not in path or first not in REPO_TOP | SUBPACKAGES:
        return []
    candidates = [ROOT / path] + ([PACKAGE / path] if first in SUBPACKAGES else [])
    found = next((c for c in candidates if c.exists()), None)
    if found is None:
        return [f"path {path} does not exist"]
    if test and f"def {test.split('[')[0]}(" not in found.read_text():
        return [f"{path} has no {test}"]
    return []


def _missing_name(dotted: str) -> list[str]:
    """``titan_dualpipe.a.b.Name``: the longest module prefix exists and defines ``Name``."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:cut])
        module = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
        if module.exists():
            rest = parts[cut:]
            if rest and rest[0] not in defined_names(module):
                return [f"{'.'.join(parts[:cut])} defines no {rest[0]}"]
            return []
    return [f"no module {dotted}"]


@lru_cache(maxsize=None)
def defined_names(module: Path) -> set[str]:
    names = set()
    for node in ast.parse(module.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def span_problems(page: Path) -> list[str]:
    text = page.read_text()
    problems = []
    for span in _spans(text) + _shell_lines(text):
        for token in _tokens(span) or span.split():
            for piece in token.split(","):  # --parts tests/gpu,check
                problems += _missing_path(piece)
        for dotted in re.findall(r"\btitan_dualpipe(?:\.\w+)+", span):
            problems += _missing_name(dotted)
    return [f"{page.relative_to(ROOT)}: {p}" for p in problems]


# ---- links ------------------------------------------------------------------------------------


def slugs(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings (code blocks left out)."""
    seen: dict[str, int] = {}
    anchors = set()
    for _, title in HEADING.findall(FENCE.sub("", page.read_text())):
        slug = re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def link_problems(page: Path) -> list[str]:
    problems = []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        resolved = (page.parent / file).resolve() if file else page
        if not resolved.exists():
            problems.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in slugs(resolved):
            problems.append(f"{target}: no heading #{anchor} in {resolved.relative_to(ROOT)}")
    return [f"{page.relative_to(ROOT)}: {p}" for p in problems]


def code_pointers() -> list[tuple[Path, str, str]]:
    """(file, page, anchor) of every ``docs/<page>.md`` or ``docs/<page>.md#<anchor>`` that the
    code, tests, configs and CI scripts point at."""
    files = [p for top in ("titan_dualpipe", "tests", "train_configs", ".ci") for p in (ROOT / top).rglob("*")
             if p.is_file() and p.suffix in (".py", ".toml", "")]
    return [(path, page, anchor) for path in sorted(files)
            for page, anchor in re.findall(r"\bdocs/([\w-]+\.md)(?:#([\w-]+))?", path.read_text(errors="replace"))]


def code_pointer_problems(pointers: list[tuple[Path, str, str]]) -> list[str]:
    problems = []
    for path, page, anchor in pointers:
        target = ROOT / "docs" / page
        if not target.exists():
            problems.append(f"{path.relative_to(ROOT)}: docs/{page} does not exist")
        elif anchor and anchor not in slugs(target):
            problems.append(f"{path.relative_to(ROOT)}: no heading #{anchor} in docs/{page}")
    return problems


# ---- the tests --------------------------------------------------------------------------------


def test_pages_show_commands() -> None:
    """The extraction finds the commands (so that the checks below cannot pass on nothing)."""
    shown = titan_dualpipe_commands()
    paths = {p for c in shown for p in subcommand_paths(c.args)}
    assert {("train",), ("check",), ("simulate",), ("draw",), ("profile",), ("csv",), ("gpu-kit",), ("matrix",),
            ("bench", "titan"), ("bench", "overlap"), ("bench", "compile"), ("bench", "runtime")} <= paths
    assert sum(not is_synopsis(c.args) for c in shown) >= 20
    assert any(c.args[:1] == ("test",) for c in bootstrap_commands())


def test_titan_dualpipe_commands() -> None:
    problems = [f"{c}\n    {p}" for c in titan_dualpipe_commands() for p in check_titan_dualpipe(c.args)]
    assert not problems, "\n".join(problems)


def test_bootstrap_commands() -> None:
    problems = [f"{c}\n    {p}" for c in bootstrap_commands() for p in check_bootstrap(c.args)]
    assert not problems, "\n".join(problems)


def test_bootstrap_commands_in_help() -> None:
    shown = bootstrap_commands_in_help()
    assert any(c.page == "titan-dualpipe matrix --help" for c in shown)
    problems = [f"{c}\n    {p}" for c in shown for p in check_bootstrap(c.args)]
    assert not problems, "\n".join(problems)


def test_readme_keeps_the_two_commands() -> None:
    """``.ci/run`` runs the README's test command; both commands stay as written."""
    readme = (ROOT / "README.md").read_text()
    assert "python3 titan_dualpipe/bootstrap.py train train_configs/debug_dualpipev.toml --nproc 2" in readme
    assert "python3 titan_dualpipe/bootstrap.py test" in readme
    assert len(readme.splitlines()) <= 250


def test_ci_removes_every_venv_it_makes() -> None:
    """``.ci/run`` removes each extra venv it makes, by the name bootstrap.py gives it for the
    options it was made with (a wrong name would leave 6 GB behind, or remove the other lane's
    venv), and never the README's ``.venv``."""
    from titan_dualpipe.bootstrap import venv_name

    script = (ROOT / ".ci" / "run").read_text().replace("\\\n", " ")

    def options(args: str) -> dict[str, str]:
        words = shlex.split(args, comments=True)
        return {words[i][2:]: words[i + 1] for i in range(len(words) - 1) if words[i] in ("--torch", "--torchtitan")}

    made, removed = set(), set()
    for venv, args in re.findall(r"\bstage (\.venv\S*) (.*)$", script, flags=re.MULTILINE):  # stage: bootstrap, then rm
        wanted = options(args)
        assert venv == venv_name(wanted.get("torch"), wanted.get("torchtitan")), (venv, args)
        made.add(venv)
        removed.add(venv)
    for args in re.findall(r"bootstrap\.py (?!\"\$\{@)(.*)$", script, flags=re.MULTILINE):  # not stage's own call
        wanted = options(args)
        made.add(venv_name(wanted.get("torch"), wanted.get("torchtitan")))
    removed |= set(re.findall(r"^\s*rm -rf (\.venv\S+)$", script, flags=re.MULTILINE))
    assert len(made) == 3 and ".venv" in made, made  # the README's, the lowest torch's, the newest's
    assert made - {".venv"} == removed, (made, removed)


def test_gpu_kit_dry_run(tmp_path: Path) -> None:
    lines = [c for c in titan_dualpipe_commands() if c.args[:1] == ("gpu-kit",) and not is_synopsis(c.args)]
    assert lines
    for c in lines:
        args = [*c.args, *([] if "--dry-run" in c.args else ["--dry-run"])]
        done = subprocess.run([sys.executable, "-m", "titan_dualpipe", *args], cwd=tmp_path,
                              capture_output=True, text=True, timeout=HELP_TIMEOUT_S)
        assert done.returncode == 0, f"{c}: exit {done.returncode}\n{done.stderr[-2000:]}"
        assert "titan_dualpipe" in done.stdout  # it listed the commands it would run


@pytest.mark.parametrize("page", LINKED_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_resolve(page: Path) -> None:
    problems = link_problems(page)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("page", COMMAND_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_paths_and_names_exist(page: Path) -> None:
    problems = span_problems(page)
    assert not problems, "\n".join(problems)


def test_code_points_at_doc_pages_that_exist() -> None:
    pointers = code_pointers()
    assert sum(bool(anchor) for _, _, anchor in pointers) >= 3
    problems = code_pointer_problems(pointers)
    assert not problems, "\n".join(problems)


def test_pictures_are_what_draw_makes(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    done = subprocess.run([sys.executable, str(ROOT / "docs" / "make_pictures.py"), str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=HELP_TIMEOUT_S)
    assert done.returncode == 0, done.stdout + done.stderr
    drawn = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    committed = {p.name for p in (ROOT / "docs").glob("*.png")}
    assert set(drawn) == committed
    assert all(data.startswith(b"\x89PNG") and len(data) > 10_000 for data in drawn.values())
    readme = (ROOT / "README.md").read_text()
    assert all(f"docs/{name}" in readme for name in committed)


# ---- the dependency rule ----------------------------------------------------------------------

# layer -> the package's modules it may import (docs/architecture.md: _compat -> orders -> weights
# -> runtime -> overlap -> titan; "" is the package itself); switches.py imports nothing at all
ALLOWED = {
    "_compat": {"_compat"},
    "orders": {"_compat", "cli", "orders"},
    "weights": {"_compat", "orders", "switches", "weights"},
    "exposure": {"exposure"},  # pure: the floor and its record
    "runtime": {"_compat", "orders", "weights", "runtime"},
    "overlap": {"_compat", "orders", "weights", "runtime", "overlap", "cut", "exposure"},
    "titan": {"", "_compat", "orders", "weights", "runtime", "overlap", "cut", "switches", "titan",
              "torchtitan_version", "exposure"},
    "switches": set(),
    "testing": {"_compat", "cut", "testing"},
    # the tools: never the benchmarks
    "sim": {"", "_compat", "cli", "cut", "orders", "weights", "runtime", "sim", "testing", "exposure", "overlap"},
    "check": {"", "_compat", "check", "cli", "cut", "launch", "orders", "runtime", "switches", "testing",
              "torchtitan_version"},
}
SWITCH_NAME = re.compile(r"TITAN_DUALPIPE_[A-Z0-9_]+")


def imported_units(path: Path) -> set[str]:
    """First-level names of this package that ``path`` imports (``""``: the package itself)."""
    package = path.relative_to(PACKAGE).parent.parts
    units = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(package[: len(package) - (node.level - 1)])
                target = base + (node.module.split(".") if node.module else [])
            elif (node.module or "").split(".")[0] == "titan_dualpipe":
                target = node.module.split(".")[1:]
            else:
                continue
            if target:
                units.add(target[0])
            else:  # from titan_dualpipe import a, b / from .. import a: submodules or the package
                units |= {a.name if (PACKAGE / a.name).exists() or (PACKAGE / f"{a.name}.py").exists() else ""
                          for a in node.names}
        elif isinstance(node, ast.Import):
            units |= {a.name.split(".")[1] for a in node.names if a.name.startswith("titan_dualpipe.")}
    return units


def layer_files(layer: str) -> list[Path]:
    module = PACKAGE / f"{layer}.py"
    return [module] if module.exists() else sorted((PACKAGE / layer).rglob("*.py"))


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_dependency_rule(layer: str) -> None:
    files = layer_files(layer)
    assert files
    problems = [f"{path.relative_to(ROOT)} imports {sorted(imported_units(path) - ALLOWED[layer])}"
                for path in files if imported_units(path) - ALLOWED[layer]]
    assert not problems, "\n".join(problems)


def imported_modules(path: Path) -> set[Path]:
    """The package's module files that ``path`` imports by relative import (TYPE_CHECKING ones too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = path.parent.joinpath(*[".."] * (node.level - 1), *(node.module or "").split(".")).resolve()
            names = [base] if node.module else [base / a.name for a in node.names]
            found |= {m for n in names for m in (n.with_suffix(".py"), n / "__init__.py") if m.exists()}
    return found


def test_runners_are_carried_by_the_exported_schedules() -> None:
    """The overlap runners reach the runtime only through the schedule classes
    overlap/schedules.py defines, which the package exports; runtime/sub_batch_runner.py imports
    neither the executor nor the schedules that read its runner."""
    runtime = PACKAGE / "runtime"
    assert (runtime / "sub_batch_runner.py").exists()
    assert not {runtime / "executor.py", runtime / "schedules.py"} & imported_modules(runtime / "sub_batch_runner.py")
    import titan_dualpipe
    from titan_dualpipe.overlap.pair import run_pair_overlapped
    from titan_dualpipe.overlap.sub_batches import TwoBatchRunner
    from titan_dualpipe.runtime import schedules
    for name in ("ScheduleDualPipeV", "ScheduleDualPipe"):
        exported = getattr(titan_dualpipe, name)
        assert issubclass(exported, getattr(schedules, name))
        assert exported.overlapped_pair_runner is run_pair_overlapped and exported.sub_batch_runner is TwoBatchRunner
        assert getattr(schedules, name).overlapped_pair_runner is None


def test_the_executor_reads_a_narrow_view_of_its_schedule() -> None:
    """The executor and the runners it calls read the schedule only through ``runtime/view.py``'s
    public fields: no name ``schedule`` in their code, and the view holds no private name."""
    import dataclasses

    from titan_dualpipe.runtime.view import ScheduleView, StepOptions, TorchStepState
    readers = [PACKAGE / "runtime" / "executor.py", PACKAGE / "runtime" / "pairs.py", PACKAGE / "overlap" / "pair.py",
               PACKAGE / "overlap" / "sub_batches.py"]
    for path in readers:
        tree = ast.parse(path.read_text())
        names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        attributes = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        assert "schedule" not in names | attributes, path
    for view in (ScheduleView, StepOptions, TorchStepState):
        assert not [f.name for f in dataclasses.fields(view) if f.name.startswith("_")]


def test_switches_load_without_torch() -> None:
    """``switches.py`` imports nothing: run on its own, it leaves torch unimported and defines
    every ``TITAN_DUALPIPE_*`` name (the package's ``__init__`` imports torch, so the file is
    run directly)."""
    path = PACKAGE / "switches.py"
    assert not [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, (ast.Import, ast.ImportFrom))]
    code = ("import json, runpy, sys; names = runpy.run_path(sys.argv[1]); "
            "assert 'torch' not in sys.modules, 'torch imported'; "
            "print(json.dumps(sorted(v for k, v in names.items() if k.endswith('_ENV'))))")
    done = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert set(json.loads(done.stdout)) == set(SWITCH_NAME.findall(path.read_text()))


def test_switch_names_spelled_only_in_switches() -> None:
    """Code in the package and the tests names a ``TITAN_DUALPIPE_*`` variable through
    ``titan_dualpipe.switches``, never as a literal of its own (docstrings aside)."""
    files = [*PACKAGE.rglob("*.py"), *(ROOT / "tests").rglob("*.py")]
    problems = []
    for path in sorted(set(files) - {PACKAGE / "switches.py"}):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and SWITCH_NAME.fullmatch(node.value):
                problems.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value}")
    assert not problems, "\n".join(problems)
