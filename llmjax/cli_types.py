"""Checks of the `llmjax` command line, shared by its subcommands (one definition each).

The `type=` functions parse one flag's text: they return the value or raise
`argparse.ArgumentTypeError` saying what was expected, which argparse prints as
`llmjax CMD: error: argument --flag: ...` and exits with status 2. `UsageError` is the same for
flags that are valid one by one but not together; `llmjax` reports it the same way.
"""

from __future__ import annotations

import argparse
import math
from urllib.parse import urlsplit


class UsageError(ValueError):
    """Flags that argparse accepted one by one but that do not work together (or with the machine:
    a result file that cannot be written); the message names the flags."""


def _number(text: str, kind: type) -> int | float:
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, "
                                         f"got {text!r}") from None


def non_empty(text: str) -> str:
    """Text with at least one non-space character (a name, a key, a host, a path), returned as
    given. An empty value is refused rather than read as the flag's default."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"expected a non-empty value, got {text!r}")
    return text


def positive_int(text: str) -> int:
    value = _number(text, int)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    value = _number(text, int)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def positive_seconds(text: str) -> float:
    """A finite number of seconds > 0 (a timeout, an interval)."""
    value = _number(text, float)
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def positive_finite(text: str) -> float:
    """A finite number > 0 (a rate, a size)."""
    value = _number(text, float)
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return value


def positive_number(text: str) -> float:
    """A number > 0; `inf` is allowed (no limit)."""
    value = _number(text, float)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0 (or inf), got {text!r}")
    return value


def fraction(text: str) -> float:
    """A number in [0, 1]."""
    value = _number(text, float)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}")
    return value


def port(text: str) -> int:
    """A TCP port, 0 to 65535 (0: any free port)."""
    value = _number(text, int)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port in 0..65535, got {text!r}")
    return value


def server_url(text: str) -> str:
    """The root URL of an HTTP server, `http(s)://host[:port]` (a trailing "/" is dropped; no path:
    the API's paths, `/v1/...`, are added to it)."""
    try:
        parts = urlsplit(text.strip())
        parts.port  # noqa: B018  raises ValueError for a port that is no number or out of range
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"bad URL {text!r}: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"expected a URL like http://127.0.0.1:8000, got {text!r}")
    if parts.path.strip("/") or parts.query or parts.fragment:
        raise argparse.ArgumentTypeError(f"expected the server's root URL, without a path (no /v1), got {text!r}")
    return f"{parts.scheme}://{parts.netloc}"


def server_urls(text: str) -> list[str]:
    """Comma-separated `server_url`s, at least one, each once."""
    urls = [server_url(u) for u in text.split(",") if u.strip()]
    if not urls:
        raise argparse.ArgumentTypeError("expected at least one URL")
    if len(set(urls)) < len(urls):
        raise argparse.ArgumentTypeError(f"a URL is listed twice in {text!r}")
    return urls


def _list_of(item_type, text: str) -> list:
    items = [item.strip() for item in text.split(",")]
    if not all(items):
        raise argparse.ArgumentTypeError(f"expected a comma-separated list without empty items, got {text!r}")
    return [item_type(item) for item in items]


def positive_int_list(text: str) -> list[int]:
    """Comma-separated positive integers, at least one (`4,8,16`)."""
    return _list_of(positive_int, text)


def non_negative_int_list(text: str) -> list[int]:
    """Comma-separated integers >= 0, at least one (seeds: `0,1,2`)."""
    return _list_of(non_negative_int, text)


def choice_list(*choices: str):
    """The `type=` of a comma-separated list of `choices`, at least one, each at most once."""
    def parse(text: str) -> list[str]:
        items = _list_of(str, text)
        unknown = [item for item in items if item not in choices]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(map(repr, unknown))}: expected some of "
                                             f"{', '.join(choices)}")
        if len(set(items)) < len(items):
            raise argparse.ArgumentTypeError(f"an item is listed twice in {text!r}")
        return items
    return parse


_UNSET = object()


def parse_quick(parser: argparse.ArgumentParser, quick: dict, argv: list[str] | None = None) -> argparse.Namespace:
    """Parse an experiment's flags (it has `--quick`, a smoke run). With `--quick`, each of `quick`'s
    values replaces its flag's default; a flag given on the command line keeps its value, so a smoke
    run can still be pointed at one setting."""
    args = parser.parse_args(argv)
    if args.quick:
        given = parser.parse_args(argv, argparse.Namespace(**dict.fromkeys(quick, _UNSET)))
        vars(args).update({name: value for name, value in quick.items() if getattr(given, name) is _UNSET})
    return args
