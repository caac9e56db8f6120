"""A function's ``def`` read from its source file, and whether that source is what runs.

:mod:`.head_path` and :mod:`.softcap_call` decide from a forward's source what its call computes;
that holds only while the function's code object is the code of the source read.
:func:`parse_def` parses the source exactly (string constants, docstrings included, as written:
the text is not dedented but nested under ``if 1:``, with line numbers moved to the file's), and
:func:`same_code` compiles that ``def`` and compares it with the function's code, instruction by
instruction. The comparison looks through how the compiler spells an attribute call
(``LOAD_METHOD`` or ``LOAD_ATTR``, and where it pushes the ``NULL``): CPython 3.11 picks one or
the other by whether the module imports the name (``torch.tanh(x)`` after ``import torch``),
which a ``def`` compiled on its own cannot reproduce. Everything else — the operations, the
names, the constants, the jumps — must be equal.
"""

from __future__ import annotations

import ast
import dis
import inspect
import types

#: Jump targets compared as instruction positions (offsets differ with the cache entries).
_JUMPS = set(dis.hasjrel) | set(dis.hasjabs)


def parse_def(fn) -> ast.FunctionDef | None:
    """The ``def`` of the plain function ``fn`` from its source file, line numbers as in the
    file, or None where the source cannot be read or is not one ``def``."""
    try:
        lines, _ = inspect.getsourcelines(fn)
    except (OSError, TypeError):
        return None
    text = "".join(lines)
    nested = bool(lines) and lines[0][:1] in (" ", "\t")
    try:
        tree = ast.parse("if 1:\n" + text if nested else text)
    except SyntaxError:
        return None
    node = tree.body[0] if tree.body else None
    if nested:
        node = node.body[0] if isinstance(node, ast.If) and node.body else None
    if not isinstance(node, ast.FunctionDef):
        return None
    first = node.decorator_list[0].lineno if node.decorator_list else node.lineno
    ast.increment_lineno(node, fn.__code__.co_firstlineno - first)
    return node


def _instructions(code: types.CodeType) -> list:
    found = list(dis.get_instructions(code))
    where = {ins.offset: i for i, ins in enumerate(found)}
    out = []
    for ins in found:
        name = "LOAD_ATTR" if ins.opname == "LOAD_METHOD" else ins.opname
        if ins.opcode in _JUMPS:
            arg = where.get(ins.argval, ins.argval)
        elif isinstance(ins.argval, types.CodeType):
            arg = None  # nested code: compared by their own instructions below
        else:
            arg = ins.argval
        out.append((name, arg))
    return out


def _same(mine: types.CodeType, theirs: types.CodeType) -> bool:
    def plain(consts):
        return tuple(c for c in consts if not isinstance(c, types.CodeType))

    def nested(consts):
        return [c for c in consts if isinstance(c, types.CodeType)]

    if (mine.co_names, mine.co_varnames, mine.co_freevars, mine.co_cellvars,
            plain(mine.co_consts)) != (theirs.co_names, theirs.co_varnames, theirs.co_freevars,
                                       theirs.co_cellvars, plain(theirs.co_consts)):
        return False
    if _instructions(mine) != _instructions(theirs):
        return False
    inner, other = nested(mine.co_consts), nested(theirs.co_consts)
    return len(inner) == len(other) and all(_same(a, b) for a, b in zip(inner, other))


def same_code(fn_def: ast.FunctionDef, fn) -> bool:
    """Whether ``fn``'s code is what ``fn_def`` (from :func:`parse_def`) compiles to."""
    tree = ast.Module(body=[fn_def], type_ignores=[])
    try:
        code = compile(tree, fn.__code__.co_filename, "exec")
    except (SyntaxError, ValueError):
        return False
    mine = next((c for c in code.co_consts if isinstance(c, types.CodeType)), None)
    return mine is not None and _same(mine, fn.__code__)
