"""One error path for the `dblast` command and the absl launchers (launch/*.py).

An *expected* failure (a missing or malformed file, an unknown name, a bad flag value, a
full disk) ends the command with ONE line on stderr -- what is wrong, which file or field,
how to fix it -- and exit status 2. Anything else is a bug: its traceback is shown and the
status is 1. `--debug` (or the environment variable DBLAST_DEBUG=1) shows the traceback of
expected failures too.

    describe(err)        -> the one-line message of an expected error, None for a bug
    report(err, prog)    -> prints it (or the traceback) and returns the exit status
    interrupted(prog)    -> Ctrl-C (SIGINT): one line, status 130
    run_absl(main, prog) -> app.run(main) with the same error path, for launch/*.py
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import math
import os
import re
import sys
import traceback
from typing import Any, Callable, Iterable, Optional, Sequence

from dblast_jax.io import paths

__all__ = ["EXIT_EXPECTED", "EXIT_BUG", "EXIT_INTERRUPTED", "UnknownNameError",
           "check_float_flags", "debug_enabled", "debug_flag", "describe", "interrupted",
           "report", "int_arg", "non_utf8_argument", "parse_finite", "parse_int", "read_json",
           "run_absl"]

EXIT_EXPECTED = 2  # an expected failure: one line on stderr
EXIT_BUG = 1  # an unexpected exception: the traceback
EXIT_INTERRUPTED = 130  # Ctrl-C (SIGINT): what a shell reports for 128 + SIGINT
DEBUG_ENV = "DBLAST_DEBUG"


class UnknownNameError(KeyError):
    """A name (experiment, preset, ...) that is not registered. A KeyError for callers
    that catch one, printed as its message (a plain KeyError prints its repr)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown name"


_DEBUG_FLAG = False  # the --debug of the command running in this process (debug_flag)


def debug_enabled(flag: bool = False) -> bool:
    """--debug given (here, or to the running command: `debug_flag`), or DBLAST_DEBUG set
    to anything but '', 0, false, no."""
    env = os.environ.get(DEBUG_ENV, "").strip().lower()
    return bool(flag) or _DEBUG_FLAG or env not in ("", "0", "false", "no", "off")


@contextlib.contextmanager
def debug_flag(on: bool):
    """While a command runs: its --debug, for code far from the command line (the
    checkpointer's filter of orbax's background error logs reads it)."""
    global _DEBUG_FLAG
    old, _DEBUG_FLAG = _DEBUG_FLAG, bool(on) or _DEBUG_FLAG
    try:
        yield
    finally:
        _DEBUG_FLAG = old


# ---- argument checks ------------------------------------------------------------------------

def non_utf8_argument(argv: Sequence[str]) -> Optional[str]:
    """The message for the first command-line argument holding bytes that are not UTF-8
    (Python keeps them as lone surrogates in sys.argv), or None when all are text."""
    for i, arg in enumerate(argv):
        if not isinstance(arg, str):
            continue
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError as e:
            prev = argv[i - 1] if i > 0 and str(argv[i - 1]).startswith("-") else None
            name = arg.split("=", 1)[0] if arg.startswith("-") and "=" in arg else prev
            where = f"the value of {name}" if name else f"argument {i + 1}"
            return (f"{where} holds bytes that are not UTF-8 text (byte "
                    f"{_surrogate_byte(arg[e.start])} at character {e.start}); pass UTF-8 "
                    "text (check the terminal's or the script's encoding, e.g. LANG=C.UTF-8)")
    return None


def _surrogate_byte(ch: str) -> str:
    code = ord(ch)
    return f"0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"U+{code:04X}"


def parse_finite(text: Any, what: str, *, minimum: Optional[float] = None,
                 strict: bool = False, maximum: Optional[float] = None,
                 example: str = "1.0") -> float:
    """A float from a flag value; refuses nan / inf and values out of range with a
    ValueError naming `what` (the flag) and an accepted example."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise ValueError(f"{what}: expected a number, got {text!r} (e.g. {example})") from None
    if not math.isfinite(value):
        raise ValueError(f"{what}: expected a finite number, got {text!r} (e.g. {example})")
    if minimum is not None and (value <= minimum if strict else value < minimum):
        rel = ">" if strict else ">="
        raise ValueError(f"{what}: must be {rel} {minimum:g}, got {text!r} (e.g. {example})")
    if maximum is not None and value > maximum:
        raise ValueError(f"{what}: must be <= {maximum:g}, got {text!r} (e.g. {example})")
    return value


def parse_int(text: Any, what: str, *, minimum: Optional[int] = None,
              example: str = "8") -> int:
    """An integer from a flag value; refuses other text and values below `minimum` with a
    ValueError naming `what` (the flag) and an accepted example."""
    try:
        value = int(str(text).strip())
    except (TypeError, ValueError):
        raise ValueError(f"{what}: expected an integer, got {text!r} (e.g. {example})") from None
    if minimum is not None and value < minimum:
        raise ValueError(f"{what}: must be >= {minimum}, got {text!r} (e.g. {example})")
    return value


def int_arg(minimum: int, example: str) -> Callable[[str], int]:
    """An argparse `type=`: an integer >= `minimum` (argparse names the flag)."""
    import argparse

    def convert(text: str) -> int:
        try:
            return parse_int(text, "value", minimum=minimum, example=example)
        except ValueError as e:  # argparse prefixes "argument --flag: "
            raise argparse.ArgumentTypeError(str(e).removeprefix("value: ")) from None
    convert.__name__ = "integer"
    return convert


# ---- files named in messages ------------------------------------------------------------------

def read_json(path: str | os.PathLike, fix: str = "fix or delete the file") -> Any:
    """json.load of `path` (local or gs://); a parse error names the file, line and column
    and `fix`."""
    if paths.is_local(path):
        with open(path, encoding="utf-8") as f:
            text = f.read()
    else:
        text = paths.read_text(path)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{os.fspath(path)}: not valid JSON at line {e.lineno} column "
                         f"{e.colno} ({e.msg}); {fix}") from None


_PATH_NAMES = ("path", "file", "filename", "fname", "cfg_path", "config_path", "index_path",
               "meta_path", "prog_path", "record", "own", "p", "f")


def _candidates(tb, suffixes: Optional[tuple[str, ...]]) -> list[str]:
    """Files the failing frames were reading, innermost frame first: open file objects, then
    path-like locals (with one of `suffixes`, when given) that exist as files."""
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    found: list[str] = []
    for frame in reversed(frames):
        if frame.f_code.co_filename.startswith(os.path.dirname(json.__file__) + os.sep):
            continue  # inside the json module: its locals are documents, not files
        local = frame.f_locals
        names = [n for n in _PATH_NAMES if n in local] + sorted(
            n for n in local if n not in _PATH_NAMES)
        handles, paths = [], []
        for n in names:
            v = local[n]
            if isinstance(v, io.IOBase) and isinstance(getattr(v, "name", None), str):
                handles.append(v.name)
            elif isinstance(v, (str, os.PathLike)):
                s = os.fspath(v)
                if (isinstance(s, str) and 0 < len(s) < 4096 and "\n" not in s
                        and (suffixes is None or s.endswith(suffixes)) and os.path.isfile(s)):
                    paths.append(s)
        for s in handles + paths:
            if s not in found:
                found.append(s)
        if found:
            return found
    return found


def _bad_json(path: str) -> Optional[tuple[int, int, str]]:
    """(line, column, reason) of the first JSON error in `path` (a .jsonl: line by line),
    or None when the file parses."""
    try:
        with open(path, encoding="utf-8") as f:
            if path.endswith(".jsonl"):
                for lineno, line in enumerate(f, 1):
                    if line.strip():
                        try:
                            json.loads(line)
                        except json.JSONDecodeError as e:
                            return lineno, e.colno, e.msg
                return None
            json.loads(f.read())
    except json.JSONDecodeError as e:
        return e.lineno, e.colno, e.msg
    except (OSError, UnicodeDecodeError):
        return None
    return None


def _json_message(err: json.JSONDecodeError) -> str:
    files = _candidates(err.__traceback__, (".json", ".jsonl"))
    for path in files:
        bad = _bad_json(path)
        if bad is not None:
            line, col, reason = bad
            fix = ("fix or delete that line" if path.endswith(".jsonl") else
                   "fix the file, or re-create it (re-export a drafter folder, rerun the "
                   "command that wrote it)")
            return f"{path}: not valid JSON at line {line} column {col} ({reason}); {fix}"
    where = f" in {files[0]}" if files else ""
    return (f"invalid JSON{where} at line {err.lineno} column {err.colno} ({err.msg}); fix "
            "the file or re-create it")


def _unicode_message(err: UnicodeDecodeError) -> str:
    files = _candidates(err.__traceback__, None)
    byte = err.object[err.start:err.start + 1].hex() if err.object else "?"
    where = files[0] if files else "a file"
    return (f"{where}: not UTF-8 text (byte 0x{byte} at offset {err.start}); the file is "
            "corrupt or not what this command reads: restore or re-create it")


def _safetensors_message(err: Exception) -> str:
    files = _candidates(err.__traceback__, (".safetensors",))
    where = files[0] if files else "a .safetensors file"
    return (f"cannot read {where}: not a complete safetensors file ({err}); the file is "
            "truncated or corrupt: re-export or restore it")


_FULL = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))


def _oserror_message(err: OSError) -> str:
    path = err.filename if err.filename is not None else None
    code = err.errno
    if path is None and code in _FULL:  # a write() failed: name the file it was writing
        files = _candidates(err.__traceback__, None)
        path = files[0] if files else "a file"
    if path is None or not err.strerror:
        text = str(err)
        return text if text else f"{type(err).__name__} (no details)"
    path = os.fsdecode(path)
    other = f" -> {os.fsdecode(err.filename2)}" if err.filename2 is not None else ""
    if code in _FULL:
        return (f"no space left on the device writing {path}{other}; free some space (or "
                "choose a folder on another disk) and rerun: finished work is kept")
    if isinstance(err, FileNotFoundError):
        return f"{path}{other}: no such file or folder; check the path"
    if isinstance(err, (FileExistsError, NotADirectoryError)):
        return (f"{path}{other}: a file is in the way where a folder is needed "
                "(or a folder where a file is needed); choose another path or move it")
    if isinstance(err, IsADirectoryError):
        return f"{path}{other}: is a folder where a file is needed; give the file's path"
    if isinstance(err, PermissionError):
        return (f"{path}{other}: permission denied; check its permissions or choose "
                "another path")
    if code == errno.EROFS:
        return f"{path}{other}: read-only file system; choose a writable folder"
    return f"{path}{other}: {err.strerror}"


# int() / float() of a config value that is not a number: which file, which field
_BAD_LITERAL = re.compile(r"(?:invalid literal for (int)\(\) with base \d+|could not convert "
                          r"string to (float)): (.+)$", re.S)
_BAD_TYPE = re.compile(r"(int|float)\(\) argument must be .*, not '(\w+)'$")


_KEY_IN_CODE = re.compile(r"""(?:\[\s*|\.get\(\s*)["']([^"']+)["']""")


def _find_values(tree: Any, match: Callable[[Any], bool], prefix: str = "",
                 depth: int = 0) -> list[tuple[str, str, Any]]:
    """(dotted key path, last key, value) of every value in a JSON-like `tree` that
    `match`es, in document order."""
    if depth > 4:
        return []
    items = (tree.items() if isinstance(tree, dict) else
             ((f"[{i}]", v) for i, v in enumerate(tree)) if isinstance(tree, list) else ())
    found = []
    for key, value in items:
        path = (f"{prefix}{key}" if str(key).startswith("[") else
                f"{prefix}.{key}" if prefix else str(key))
        if match(value):
            found.append((path, str(key), value))
        if isinstance(value, (dict, list)):
            found += _find_values(value, match, path, depth + 1)
    return found


def _failing_code(tb) -> str:
    """The source of the expression that raised (its columns, Python >= 3.11; else the
    whole line)."""
    summary = traceback.extract_tb(tb)[-1] if tb is not None else None
    if summary is None or not summary.line:
        return ""
    line, start, end = summary.line, getattr(summary, "colno", None), getattr(
        summary, "end_colno", None)
    if start is not None and end is not None and getattr(summary, "end_lineno", None) == \
            summary.lineno:
        import linecache
        raw = linecache.getline(summary.filename, summary.lineno)
        return raw[start:end] or line
    return line


def _config_field_message(err: Exception) -> Optional[str]:
    """For int() / float() of a value read from a JSON file (a drafter's or a model's
    config.json): '<file>: field <key> must be an integer, got ...'; None when the value
    or the file cannot be found in the failing frames."""
    text = str(err)
    literal = _BAD_LITERAL.match(text) if isinstance(err, ValueError) else None
    wrong_type = _BAD_TYPE.match(text) if isinstance(err, TypeError) else None
    if literal:
        kind, shown = literal.group(1) or literal.group(2), literal.group(3)
        match = lambda v: isinstance(v, str) and repr(v) == shown  # noqa: E731
    elif wrong_type:
        kind, typename = wrong_type.group(1), wrong_type.group(2)
        match = lambda v: type(v).__name__ == typename  # noqa: E731
    else:
        return None
    files = _candidates(err.__traceback__, (".json",))
    if not files:
        return None
    hints = set(_KEY_IN_CODE.findall(_failing_code(err.__traceback__)))
    tb, frames = err.__traceback__, []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    for frame in reversed(frames):
        found = []
        for value in list(frame.f_locals.values()):
            if isinstance(value, dict):
                found += _find_values(value, match)
        named = [f for f in found if f[1] in hints]
        # a type (a list where a number belongs) is only trusted with the key in the code
        pick = named[0] if named else (found[0] if found and literal else None)
        if pick is not None:
            field, _, bad = pick
            want = "an integer" if kind == "int" else "a number"
            try:
                shown = json.dumps(bad)
            except (TypeError, ValueError):
                shown = repr(bad)
            return (f"{files[0]}: field {field!r} must be {want}, got {shown}; fix the file, "
                    "or re-create it (re-export the drafter, fetch the model again)")
    return None


def _uri_in_frames(tb) -> str:
    """The object-store URI (gs://...) the failing frames were working on, innermost
    first ('' when none)."""
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    for frame in reversed(frames):
        for value in frame.f_locals.values():
            if isinstance(value, os.PathLike) and not isinstance(value, str):
                value = str(value)
            if isinstance(value, str) and len(value) < 4096 and "\n" not in value \
                    and not paths.is_local(value):
                return value
    return ""


def _one_line(text: str) -> str:
    return "; ".join(part.strip() for part in str(text).splitlines() if part.strip())


def describe(err: BaseException) -> Optional[str]:
    """The one-line message of an expected failure, or None for an unexpected one (a bug:
    show its traceback)."""
    if isinstance(err, ImportError):  # gs:// without the gcs extra; other imports: bugs
        backend = paths.missing_backend(err, _uri_in_frames(err.__traceback__))
        return _one_line(backend) if backend else None
    if isinstance(err, json.JSONDecodeError):
        return _one_line(_json_message(err))
    if isinstance(err, UnicodeDecodeError):
        return _one_line(_unicode_message(err))
    if type(err).__name__ == "SafetensorError":
        return _one_line(_safetensors_message(err))
    if isinstance(err, KeyError):
        # a registry lookup's message ("unknown experiment 'x'; known: ..."); a bare missing
        # key (KeyError('hidden_size')) is a bug until proven otherwise
        if isinstance(err, UnknownNameError):
            return _one_line(str(err))
        arg = err.args[0] if len(err.args) == 1 else None
        if isinstance(arg, str) and " " in arg.strip():
            return _one_line(arg)
        return None
    if isinstance(err, OSError):
        return _one_line(_oserror_message(err))
    if isinstance(err, (ValueError, TypeError)):  # a config field that is not a number
        field = _config_field_message(err)
        if field is not None:
            return _one_line(field)
    if isinstance(err, ValueError):
        return _one_line(str(err)) or f"{type(err).__name__} (no details)"
    if isinstance(err, MemoryError):
        return ("out of host memory; lower --batch-size / --seq-len (or the config's) or use "
                "a machine with more RAM")
    name = type(err).__name__
    if name in ("FetchError", "UsageError"):  # dblast_jax.io.fetch, absl.app
        return _one_line(str(err))
    if name in ("XlaRuntimeError", "JaxRuntimeError") and "RESOURCE_EXHAUSTED" in str(err):
        first = _one_line(str(err))[:300]
        return (f"out of accelerator memory ({first}); lower --batch-size / seq_len or use "
                "a smaller model")
    return None


def report(err: BaseException, prog: str, debug: bool = False,
           stream=None) -> int:
    """Print `err` for the user of `prog`; returns the exit status (2 expected, 1 bug)."""
    stream = stream or sys.stderr
    if isinstance(err, BrokenPipeError) and err.filename is None and not debug_enabled(debug):
        # stdout's reader went away (`... | head`): nothing to report; keep the interpreter
        # from failing again when it flushes stdout at exit (the Python docs' recipe)
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):
            pass
        return 128 + 13  # what a shell reports for a process ended by SIGPIPE
    message = describe(err)
    if message is None or debug_enabled(debug):
        traceback.print_exception(type(err), err, err.__traceback__, file=stream)
        if message is not None:
            print(f"{prog}: error: {message}", file=stream)
        stream.flush()
        return EXIT_BUG if message is None else EXIT_EXPECTED
    print(f"{prog}: error: {message}", file=stream)
    stream.flush()
    return EXIT_EXPECTED


def interrupted(prog: str, err: Optional[BaseException] = None, debug: bool = False,
                exit_now: bool = False, stream=None) -> int:
    """Ctrl-C (a KeyboardInterrupt that reached the command): one line on stderr and
    status 130; the traceback only with --debug / DBLAST_DEBUG=1. Work already finished
    is on disk (every writer writes atomically and resumes), so the line says to rerun.

    exit_now: end the process here (os._exit, after flushing stdout and stderr) instead
    of returning: an interpreter torn down while JAX's runtime threads still run the
    interrupted computation can crash (a segmentation fault, status 139). By then the
    command's own cleanup (locks released, files closed) has run as the interrupt
    unwound the stack. Only for a process run as a program, never inside a caller."""
    stream = stream or sys.stderr
    if err is not None and debug_enabled(debug):
        traceback.print_exception(type(err), err, err.__traceback__, file=stream)
    print(f"{prog}: interrupted; rerun the same command to resume", file=stream)
    for s in (sys.stdout, stream):
        try:
            s.flush()
        except (OSError, ValueError):
            pass
    if exit_now:
        os._exit(EXIT_INTERRUPTED)
    return EXIT_INTERRUPTED


# ---- absl launchers ----------------------------------------------------------------------------

def check_float_flags(values: Iterable[tuple[str, Any]], **limits) -> None:
    """Refuse nan / inf (and values out of `limits`) in (flag name, value or list) pairs."""
    for name, value in values:
        if value is None:
            continue
        items = value if isinstance(value, (list, tuple)) else [value]
        for v in items:
            parse_finite(v, f"--{name}", **limits)


def run_absl(main: Callable[[list], Any], prog: str) -> None:
    """`absl.app.run(main)` with the dblast error path: a flag error or an expected failure
    in `main` is one line on stderr and exit status 2; `--debug` (define it in the launcher)
    or DBLAST_DEBUG=1 shows tracebacks."""
    from absl import app, flags

    def parse(argv):
        bad = non_utf8_argument(argv[1:])
        if bad:
            print(f"{prog}: error: {bad}", file=sys.stderr)
            sys.exit(EXIT_EXPECTED)
        try:
            return flags.FLAGS(argv)
        except flags.Error as e:
            print(f"{prog}: error: {_one_line(str(e))} (--helpshort lists the flags)",
                  file=sys.stderr)
            sys.exit(EXIT_EXPECTED)

    def debug() -> bool:
        return bool(getattr(flags.FLAGS, "debug", False)) if "debug" in flags.FLAGS else False

    def guarded(argv):
        try:
            with debug_flag(debug()):
                return main(argv)
        except SystemExit:
            raise
        except KeyboardInterrupt as err:  # Ctrl-C: one line, status 130
            return interrupted(prog, err, debug(), exit_now=True)
        except Exception as err:  # noqa: BLE001 -- sorted into expected / bug by describe
            return report(err, prog, debug())

    app.run(guarded, flags_parser=parse)
