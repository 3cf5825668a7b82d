"""The docstrings' Sphinx markup as the site's Markdown, at build time (a griffe extension,
named in mkdocs.yml).

The docstrings are written once, for ``help()`` and Sphinx-style readers: roles
(``:func:`dropout```, ``:class:`~torch_pallas.sharding.Sharding```, ``:data:``, ``:mod:``,
``:meth:``, ``:attr:``, ``:exc:``, ``:math:``, ``:ref:``) and ``Example::`` literal blocks.
Rewriting them as Markdown would make them worse in ``help()``; converting here keeps one
text and lets the build check every reference:

- a torch_pallas name (absolute, or relative to where the docstring is, as Sphinx resolves
  it) becomes a cross-reference of mkdocs-autorefs, which fails the ``--strict`` build when
  its target is not in the API reference;
- a torch, JAX or other library name becomes inline code (no external inventory is reachable
  offline); a bare name that resolves nowhere is an error;
- ``:ref:`title <anchor>``` links a heading of the docs pages (by its anchor);
- ``:math:`...``` becomes inline code (its TeX reads well enough, and the site needs no math
  renderer from a CDN), ``text::`` ends in ``:``.

Two more things the source says in its own way:

- docstrings assigned as ``obj.__doc__ = TEMPLATE.format(name="...")`` (one text for several
  functions or classes) are filled in from the source, as Python fills them in at import;
- a constant's comment (the ``#`` lines above it, or one after it on its line) is its
  docstring, so that the reference shows it and the constants docstrings name resolve.

griffe's own check of the ``Args:`` names is off (mkdocs.yml): it takes a row naming several
parameters (``p, training, seed, generator, impl: as for dropout``), the project's way to
refer to where they are defined, as one unknown name. :func:`check_parameter_names` checks
every name of every row instead.

Docstrings assigned as ``obj.__doc__ = TEMPLATE.format(name="...")`` (one text for several
functions or classes) are filled in from the source, as Python fills them in at import.
"""

from __future__ import annotations

import ast
import logging
import re

import griffe

_logger = logging.getLogger("mkdocs.plugins.torch_pallas.sphinx_roles")
ROLE = re.compile(r":(?P<role>func|class|meth|mod|data|attr|exc|obj|ref|math):`(?P<text>[^`]+)`")
TITLED = re.compile(r"(?P<title>.*?)\s*<(?P<target>[^>]+)>$")
PACKAGE = "torch_pallas"


class SphinxRoles(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, **kwargs) -> None:
        if pkg.name != PACKAGE:
            return
        like = pkg.docstring  # the parser and its options, for the docstrings made here
        for obj in _objects(pkg):
            if isinstance(obj, griffe.Module):
                _fill_formatted_docstrings(obj, like)
            elif obj.is_attribute and obj.docstring is None:
                _comment_as_docstring(obj, like)
        for obj in _objects(pkg):
            if obj.docstring is not None:
                obj.docstring.value = convert(obj.docstring.value, obj)
                check_parameter_names(obj)


def _objects(obj: griffe.Object):
    yield obj
    for member in obj.members.values():
        if not member.is_alias:
            yield from _objects(member)


def convert(text: str, obj: griffe.Object) -> str:
    text = ROLE.sub(lambda match: _role(match["role"], match["text"], obj), text)
    # An RST literal block's marker ("Example::", "...compiles it::") ends the line in ":".
    return re.sub(r"(?m)(\S)::$", r"\1:", text)


def _role(role: str, text: str, obj: griffe.Object) -> str:
    if role == "math":
        return f"`{text}`"  # readable as it is; no math renderer to fetch offline
    if role == "ref":
        titled = TITLED.match(text)
        title, anchor = (titled["title"], titled["target"]) if titled else (text.replace("-", " "), text)
        return f"[{title}][{anchor}]"
    short = text.startswith("~")
    name = text.lstrip("~!")
    shown = name.rsplit(".", 1)[-1] if short else name
    target = _resolve(name, obj)
    if target is None:
        return f"`{shown}`"
    return f"[`{shown}`][{target}]"


def _resolve(name: str, obj: griffe.Object) -> str | None:
    """The torch_pallas path ``name`` refers to from ``obj``'s docstring; ``None`` for another
    library's name."""
    if name == PACKAGE or name.startswith(PACKAGE + "."):
        return name
    first, _, rest = name.partition(".")
    try:
        resolved = obj.resolve(first)
    except griffe.NameResolutionError:
        if rest or "__getattr__" in obj.module.members:
            return None  # torch.nn.functional.dropout, jax.random.key, a module's lazy attribute
        _logger.warning(f"{obj.path}: the docstring names {name!r}, which resolves to nothing there")
        return None
    path = f"{resolved}.{rest}" if rest else resolved
    if not (path == PACKAGE or path.startswith(PACKAGE + ".")):
        return None
    # Private names are left out of the reference (mkdocs.yml's filters): shown as code.
    return None if any(part.startswith("_") and not part.startswith("__") for part in path.split(".")) else path


def check_parameter_names(obj: griffe.Object) -> None:
    """Every name an ``Args:`` row names is a parameter of ``obj`` (a row may name several:
    ``p, training, seed: as for dropout``)."""
    if not (obj.is_function or obj.is_class):
        return
    parameters = {parameter.name for parameter in obj.parameters}
    for section in obj.docstring.parse(warn_unknown_params=False, warn_missing_types=False):
        if section.kind is not griffe.DocstringSectionKind.parameters:
            continue
        for row in section.value:
            unknown = [name for name in row.name.split(", ") if name.lstrip("*") not in parameters]
            if unknown:
                _logger.warning(f"{obj.path}: its docstring's Args name {', '.join(unknown)}, not parameters of it")


def _comment_as_docstring(attribute: griffe.Attribute, like: griffe.Docstring) -> None:
    """The ``#`` comment above a constant (or after it on its line) as its docstring."""
    lines = attribute.lines_collection[attribute.filepath] if attribute.filepath else None
    if not lines or attribute.lineno is None:
        return
    line = lines[attribute.lineno - 1]
    start = attribute.lineno - 1
    if attribute.parent.is_module:
        # A constant set in the branches of an ``if`` (one per stack, say): the comment above the ``if``.
        while start > 0 and lines[start][:1].isspace():
            start -= 1
    comment = []
    for above in reversed(lines[:start]):
        if not above.strip().startswith("#"):
            break
        comment.insert(0, above.strip().removeprefix("#").strip())
    if not comment and "  # " in line:
        comment = [line.split("  # ", 1)[1]]
    if comment:
        _set_docstring(attribute, "\n".join(comment), attribute.lineno, like)


def _set_docstring(obj: griffe.Object, text: str, lineno: int, like: griffe.Docstring) -> None:
    obj.docstring = griffe.Docstring(text, lineno=lineno, parent=obj, parser=like.parser,
                                     parser_options=like.parser_options)


def _fill_formatted_docstrings(module: griffe.Module, like: griffe.Docstring) -> None:
    """``f.__doc__ = "text"`` or ``TEMPLATE.format(key="literal", ...)`` at module level, and
    ``__doc__ = TEMPLATE.format(...)`` in a class body, as their docstrings."""
    if module.filepath is None or isinstance(module.filepath, list):
        return
    tree = ast.parse(module.filepath.read_text())
    templates = {node.targets[0].id: node.value.value for node in tree.body
                 if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
                 and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)}
    assignments = [(node.targets[0].value.id, node.value) for node in tree.body
                   if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Attribute)
                   and node.targets[0].attr == "__doc__" and isinstance(node.targets[0].value, ast.Name)]
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            assignments += [(node.name, statement.value) for statement in node.body
                             if isinstance(statement, ast.Assign) and isinstance(statement.targets[0], ast.Name)
                             and statement.targets[0].id == "__doc__"]
    for name, value in assignments:
        if isinstance(value, ast.Constant) and isinstance(value.value, str):
            text = value.value
        elif (isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr == "format"
                and isinstance(value.func.value, ast.Name) and value.func.value.id in templates):
            text = templates[value.func.value.id].format(
                **{keyword.arg: ast.literal_eval(keyword.value) for keyword in value.keywords})
        else:
            _logger.warning(f"{module.path}.{name}: a __doc__ assignment this extension cannot read")
            continue
        _set_docstring(module.members[name], text, value.lineno, like)
