#!/usr/bin/env python3
"""Writes the book's Python API page, ``docs/src/reference/python-api.md``, from the docstrings
of the ``cellc`` package (which it imports: run it with torch and cellc installed).

    python docs/gen_python_api.py           # rewrite the page
    python docs/gen_python_api.py --check   # exit 1 when the page differs from what it would write

The public API is what ``cellc.__all__`` names: its classes with their public methods and
properties, its functions, the module ``cellc.errors`` with its exceptions, plus the custom
operators the package registers (``torch.ops.cellc.*``). Docstrings are Google-style: prose,
then sections (``Args:``, ``Returns:``, ``Raises:``, ``Attributes:``, ``Example:``) whose
items are ``name: text`` lines. ``runtime/python/tests/test_docs.py`` imports this file to walk
the same items, and fails when one lacks a docstring, an argument is not named under ``Args:``,
or the page is stale.

The page depends only on the docstrings and signatures (annotations are kept as written,
``from __future__ import annotations``), so it is the same for every torch version.
"""

from __future__ import annotations

import argparse
import inspect
import re
import sys
from dataclasses import dataclass
from pathlib import Path

PAGE = Path(__file__).resolve().parent / "src" / "reference" / "python-api.md"

SECTIONS = {"Args": "Arguments", "Returns": "Returns", "Raises": "Raises", "Attributes": "Attributes",
            "Example": "Example", "Examples": "Examples"}
LISTS = ("Args", "Raises", "Attributes")  # sections of `name: text` items
WIDTH = 96  # a signature longer than this is written one parameter a line


@dataclass
class Item:
    """One documented object of the public API."""

    title: str  # the name the page shows: ``cellc.RNN``, ``RNN.forward``, ``torch.ops.cellc.rnn_forward``
    kind: str  # "module", "class", "method", "property", "function", "exception", "operator"
    obj: object  # what carries the docstring
    func: object = None  # what carries the parameters (a class's ``__init__``; None: no signature)
    level: int = 2  # the heading's level on the page


def public_items() -> list[Item]:
    """Every documented object of the public API, in the page's order."""
    import cellc  # noqa: PLC0415 -- needs torch: imported when asked for, not when this file is

    classes, functions, exceptions, errors_module = [], [], [], None
    for name in cellc.__all__:
        obj = getattr(cellc, name)
        if inspect.ismodule(obj):
            errors_module = Item(f"cellc.{name}", "module", obj)
        elif inspect.isclass(obj) and issubclass(obj, BaseException):
            exceptions.append(Item(f"cellc.{name}", "exception", obj, level=3))
        elif inspect.isclass(obj):
            classes.append(Item(f"cellc.{name}", "class", obj, obj.__init__))
            classes.extend(_members(name, obj))
        elif callable(obj):
            functions.append(Item(f"cellc.{name}", "function", obj, obj, level=3))
        # Other names (``__version__``) are documented under the module's ``Attributes:``.
    items = [Item("cellc", "module", cellc), *classes]
    items += [Item("Functions", "heading", None), *functions]
    if errors_module is not None:
        items.append(errors_module)
    # The base class first, then the others by name.
    items += sorted(exceptions, key=lambda item: (len(item.obj.__mro__), item.title))
    items += [Item("Operators", "heading", None), *_operators()]
    return items


def _members(class_name: str, cls: type) -> list[Item]:
    """A class's own public methods and properties: ``forward`` first, the rest as defined."""
    names = [n for n in vars(cls) if not n.startswith("_")]
    names.sort(key=lambda n: n != "forward")
    out = []
    for n in names:
        attr = vars(cls)[n]
        if isinstance(attr, property):
            out.append(Item(f"{class_name}.{n}", "property", attr, level=3))
        elif inspect.isfunction(attr):
            out.append(Item(f"{class_name}.{n}", "method", attr, attr, level=3))
    return out


def _operators() -> list[Item]:
    """The ``torch.library`` custom operators cellc defines (``torch.ops.cellc.*``)."""
    from cellc import _ops  # noqa: PLC0415

    found = []
    for value in vars(_ops).values():
        init = getattr(value, "_init_fn", None)  # a torch.library.CustomOpDef's Python function
        if init is not None and hasattr(value, "register_fake"):
            found.append(Item(f"torch.ops.{value._namespace}.{value._name}", "operator", init, init, level=3))
    return found  # as defined: the forward, then the backward


def docstring(obj) -> str:
    """An object's own docstring, cleaned (not one inherited from a base class)."""
    doc = obj.__doc__ if isinstance(obj, property) or not inspect.isclass(obj) else vars(obj).get("__doc__")
    return inspect.cleandoc(doc) if doc else ""


def parameters(func) -> list[inspect.Parameter]:
    """A function's parameters without ``self``/``cls``."""
    params = list(inspect.signature(func).parameters.values())
    if params and params[0].name in ("self", "cls"):
        params = params[1:]
    return params


# ---------------------------------------------------------------------------------------------
# Docstrings: sections


def sections(doc: str) -> list[tuple[str | None, list[str]]]:
    """A docstring as ``(section, lines)`` pairs: ``None`` for prose, else the section's name
    (``"Args"``, ...) with its body, dedented."""
    out: list[tuple[str | None, list[str]]] = [(None, [])]
    for line in doc.splitlines():
        header = re.fullmatch(r"(\w+):", line)
        if header and header.group(1) in SECTIONS:
            out.append((header.group(1), []))
        elif out[-1][0] is not None and line.strip() and not line.startswith(" "):
            out.append((None, [line]))  # prose again after a section
        else:
            out[-1][1].append(line)
    cleaned = []
    for name, lines in out:
        while lines and not lines[-1].strip():
            lines.pop()
        while lines and not lines[0].strip():
            lines.pop(0)
        if lines:
            cleaned.append((name, inspect.cleandoc("\n".join(lines)).splitlines() if name else lines))
    return cleaned


def section_items(lines: list[str]) -> list[tuple[list[str], str]]:
    """A list section's items: ``(names, text)``; ``"bias, proj_size: ..."`` names two."""
    items: list[tuple[list[str], list[str]]] = []
    for line in lines:
        item = re.fullmatch(r"(\*{0,2}[\w.]+(?:, \*{0,2}[\w.]+)*): ?(.*)", line)
        if item and not line.startswith(" "):
            items.append(([n.strip() for n in item.group(1).split(",")], [item.group(2)]))
        elif items:
            items[-1][1].append(line.strip())
        else:
            raise ValueError(f"a section line outside any item: {line!r}")
    return [(names, " ".join(t for t in text if t)) for names, text in items]


def documented_names(doc: str, section: str = "Args") -> set[str]:
    """The names a docstring's section (``Args`` by default) documents."""
    names = set()
    for name, lines in sections(doc):
        if name == section:
            for item_names, _ in section_items(lines):
                names.update(item_names)
    return names


# ---------------------------------------------------------------------------------------------
# Markdown


def inline(text: str) -> str:
    """reStructuredText inline markup as Markdown: ````x```` and ``:func:`x``` become code."""
    text = re.sub(r":(?:func|meth|class|mod|attr|data|exc):`~?([^`]+)`", r"`\1`", text)
    return re.sub(r"``(.+?)``", r"`\1`", text, flags=re.DOTALL)


def prose(lines: list[str]) -> list[str]:
    """Paragraphs; a paragraph ending in ``::`` is followed by a literal block (a text fence)."""
    out, paragraph, i = [], [], 0

    def flush():
        # Inline markup may span the lines of a paragraph.
        out.extend(inline("\n".join(paragraph)).splitlines())
        paragraph.clear()

    while i < len(lines):
        line = lines[i]
        if not line.strip():
            flush()
            out.append("")
            i += 1
            continue
        if line.endswith("::"):
            paragraph.append(line[:-1])
            flush()
            block, i = [], i + 1
            while i < len(lines) and (not lines[i].strip() or lines[i].startswith(" ")):
                block.append(lines[i])
                i += 1
            while block and not block[-1].strip():
                block.pop()
            out += ["", "```text", *inspect.cleandoc("\n".join(block)).splitlines(), "```", ""]
            continue
        paragraph.append(line)
        i += 1
    flush()
    return out


def render_doc(doc: str) -> list[str]:
    """A docstring as Markdown lines."""
    out: list[str] = []
    for name, lines in sections(doc):
        if name is None:
            out += prose(lines)
        elif name in LISTS:
            out.append(f"**{SECTIONS[name]}**")
            out.append("")
            for names, text in section_items(lines):
                out.append(f"- {', '.join(f'`{n}`' for n in names)}: {inline(text)}")
        elif name.startswith("Example"):
            out += [f"**{SECTIONS[name]}**", "", "```text", *lines, "```"]
        else:
            out.append(f"**{SECTIONS[name]}**: {inline(' '.join(line.strip() for line in lines))}")
        out.append("")
    while out and not out[-1]:
        out.pop()
    # Collapse runs of blank lines (literal blocks end with one).
    return [line for i, line in enumerate(out) if line or (i > 0 and out[i - 1])]


def _annotation(annotation) -> str:
    return annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)


def signature(title: str, func) -> str:
    """``title(params) -> returns``, as written in the source; one parameter a line when long."""
    sig = inspect.signature(func)
    params, seen_star = [], False
    for p in parameters(func):
        if p.kind is p.KEYWORD_ONLY and not seen_star:
            params.append("*")
            seen_star = True
        text = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "") + p.name
        seen_star = seen_star or p.kind is p.VAR_POSITIONAL
        if p.annotation is not p.empty:
            text += f": {_annotation(p.annotation)}"
        if p.default is not p.empty:
            text += f" = {p.default!r}" if p.annotation is not p.empty else f"={p.default!r}"
        params.append(text)
    returns = "" if sig.return_annotation is sig.empty else f" -> {_annotation(sig.return_annotation)}"
    one_line = f"{title}({', '.join(params)}){returns}"
    if len(one_line) <= WIDTH:
        return one_line
    return "\n".join([f"{title}(", *(f"    {p}," for p in params), f"){returns}"])


def render_item(item: Item) -> list[str]:
    hashes = "#" * item.level
    if item.kind == "heading":
        return [f"{hashes} {item.title}"]
    if item.kind == "module" and item.title == "cellc":
        return render_doc(docstring(item.obj))  # the page's introduction
    out = [f"{hashes} `{item.title}`", ""]
    if item.kind == "exception":
        bases = ", ".join(b.__name__ for b in item.obj.__bases__)
        out += ["```text", f"class {item.obj.__name__}({bases})", "```", ""]
    elif item.kind == "property":
        returns = inspect.signature(item.obj.fget).return_annotation
        kind = "" if returns is inspect.Signature.empty else f": {_annotation(returns)}"
        out += ["```text", f"{item.title}{kind}  (a read-only property)", "```", ""]
    elif item.func is not None:
        out += ["```text", signature(item.title, item.func), "```", ""]
    return out + render_doc(docstring(item.obj))


def page() -> str:
    import cellc  # noqa: PLC0415

    head = [
        "# Python API",
        "",
        "<!-- Generated by docs/gen_python_api.py from the docstrings of the cellc package: do not",
        "     edit; run `python docs/gen_python_api.py` after changing a docstring. -->",
        "",
        f"Everything `import cellc` offers (`cellc.__all__`: {len(cellc.__all__)} names), with each",
        "argument, result and exception, as the package's docstrings say (`help(cellc.RNN)` shows",
        "the same text). The guides show it at work: [Python: cellc.RNN](../guides/python.md) and",
        "[Variable-length batches](../guides/varlen.md).",
        "",
    ]
    body: list[str] = []
    for item in public_items():
        body += render_item(item)
        body.append("")
    return "\n".join(head + body).rstrip("\n") + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when the page is stale; write nothing")
    args = ap.parse_args()
    text = page()
    if args.check:
        if not PAGE.is_file() or PAGE.read_text(encoding="utf-8") != text:
            print(f"{PAGE} is stale: run python docs/gen_python_api.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text, encoding="utf-8")
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
