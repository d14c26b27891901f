"""Shape expressions: arithmetic on a kernel's generics and sizes, in ``shape=``,
``tile=`` and the launch geometry (``grid=``, ``block=``, ``shared_mem=``,
``cluster=``)::

    Out("q", "float32", shape=("HQ*HD",))
    In("w_qkv", "bfloat16", shape=("(HQ+2*HKV)*HD", "K"))
    Out("part", "float32", shape=("B", "2*C+4"), tile=(1, "2*C+4"))

An expression is ints and names joined by ``+ - * // %`` and parentheses,
read once when the kernel is declared (a tiny parser: nothing is ``eval``-ed)
and evaluated with the launch's values.  A name is a generic, a size the
shapes name, or an int ``Scalar`` parameter (its argument's value).

What the arguments determine (``bind`` in signature.py, the same rule at
declaration for ``inferable``): first every bare name binds to the dimension it
names, parameter by parameter; then each expression with one name still
unknown is solved for it, where that is unambiguous: the name occurs once, and
only under ``+``, ``-`` and ``*`` by known values (``HQ*HD`` with HD known
gives HQ; ``2*C+4`` gives C; ``HD//2`` gives nothing: HD may be odd or even).
"""
from __future__ import annotations

import re

from ..errors import LaunchError, ShapeError

_TOKEN = re.compile(r"\s*(?:(\d+)|([A-Za-z_]\w*)|(//|[-+*%()]))")
_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b,
        "//": lambda a, b: a // b, "%": lambda a, b: a % b}
GRAMMAR = ("ints and names joined by + - * // % and parentheses (e.g. 'HQ*HD', '2*C+4', '(N+255)//256')")


class Expr:
    """One parsed shape expression: ``eval(env)``, ``solve(value, env)``; equal
    (and shown) by its text."""

    __slots__ = ("text", "tree", "names")

    def __init__(self, text: str, tree):
        self.text, self.tree = text, tree
        self.names = tuple(dict.fromkeys(_names(tree)))  # in order of appearance

    def __str__(self) -> str:
        return self.text

    __repr__ = __str__

    def __eq__(self, other) -> bool:
        return isinstance(other, Expr) and other.text == self.text

    def __hash__(self) -> int:
        return hash(self.text)

    def eval(self, env) -> int:
        """The value with every name in ``env`` (ints); a ShapeError for a division by zero,
        a LaunchError for a name whose value is not an int (a C++ type name)."""
        return _eval(self.tree, env, self)

    def substituted(self, env) -> str:
        """The text with each name replaced by its value (``(8+2*2)*64``)."""
        return _TOKEN_NAME.sub(lambda m: str(env.get(m.group(0), m.group(0))), self.text.replace(" ", ""))

    def solvable_for(self, name: str) -> bool:
        """Is ``name`` determined by this expression's value once the other names are known?"""
        return _occurrences(self.tree, name) == 1 and _linear_path(self.tree, name)

    def solve(self, value: int, env) -> int | None:
        """The one value of the unknown name (``solvable_for``) that gives ``value``, or None."""
        return _invert(self.tree, value, env, self)


_TOKEN_NAME = re.compile(r"[A-Za-z_]\w*")


def parse(text: str, where: str) -> "Expr | str | int":
    """``text`` read as a dimension: an int, a bare name (a str) or an Expr;
    ``where`` names it in the LaunchError of text that is not one."""
    tokens, pos, s = [], 0, text.rstrip()
    while pos < len(s):
        m = _TOKEN.match(s, pos)
        if m is None or m.end() == pos:
            raise LaunchError(f"{where}: cannot read {text!r} at {s[pos:].strip()!r}: a dimension is an int, -1 (any), "
                              f"a name or {GRAMMAR}")
        tokens.append(int(m.group(1)) if m.group(1) is not None else m.group(2) or m.group(3))
        pos = m.end()
    reader = _Reader(tokens, text, where)
    tree = reader.expr()
    if reader.i != len(tokens):
        reader.fail(f"unexpected {tokens[reader.i]!r}")
    if isinstance(tree, (int, str)):  # '4' or ' HD ': no arithmetic to do
        return tree
    return Expr(" ".join(text.split()), tree)


class _Reader:
    """Recursive descent: expr := term (('+'|'-') term)*; term := atom (('*'|'//'|'%') atom)*;
    atom := int | name | '(' expr ')'.  A tree is an int, a name (str) or (op, left, right)."""

    def __init__(self, tokens, text, where):
        self.tokens, self.text, self.where, self.i = tokens, text, where, 0

    def fail(self, why: str):
        raise LaunchError(f"{self.where}: cannot read {self.text!r} ({why}): a dimension is an int, -1 (any), a name "
                          f"or {GRAMMAR}")

    def peek(self):
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def expr(self):
        tree = self.term()
        while self.peek() in ("+", "-"):
            op = self.tokens[self.i]
            self.i += 1
            tree = (op, tree, self.term())
        return tree

    def term(self):
        tree = self.atom()
        while self.peek() in ("*", "//", "%"):
            op = self.tokens[self.i]
            self.i += 1
            tree = (op, tree, self.atom())
        return tree

    def atom(self):
        tok = self.peek()
        self.i += 1
        if tok == "(":
            tree = self.expr()
            if self.peek() != ")":
                self.fail("a '(' is not closed")
            self.i += 1
            return tree
        if tok is None or tok in _OPS or tok == ")":
            self.fail("a number or a name is missing" if tok is None else f"unexpected {tok!r}")
        return tok


def _names(tree):
    if isinstance(tree, str):
        yield tree
    elif isinstance(tree, tuple):
        yield from _names(tree[1])
        yield from _names(tree[2])


def _eval(tree, env, expr: Expr) -> int:
    if type(tree) is int:
        return tree
    if isinstance(tree, str):
        v = env[tree]
        if type(v) is not int:
            raise LaunchError(f"{tree}={v!r} in the shape expression {expr.text}: it is used as a number, so give "
                              f"{tree} an int")
        return v
    op, left, right = tree
    a, b = _eval(left, env, expr), _eval(right, env, expr)
    if op in ("//", "%") and b == 0:
        raise ShapeError(f"the shape expression {expr.text} = {expr.substituted(env)} divides by zero; give "
                         f"{_names_text(_names(right))} a value that is not zero")
    return _OPS[op](a, b)


def _names_text(names) -> str:
    return ", ".join(dict.fromkeys(names)) or "it"


def _occurrences(tree, name: str) -> int:
    return sum(1 for n in _names(tree) if n == name)


def _linear_path(tree, name: str) -> bool:
    """Does the path from the root to ``name`` pass only through + - *?"""
    if tree == name:
        return True
    if not isinstance(tree, tuple):
        return False
    op, left, right = tree
    inner = left if name in set(_names(left)) else right
    return op in ("+", "-", "*") and _linear_path(inner, name)


def _invert(tree, target: int, env, expr: Expr) -> int | None:
    if isinstance(tree, str):
        return target if target >= 0 else None  # a size or a count is never negative
    op, left, right = tree
    unknown_left = any(n not in env for n in _names(left))
    known = _eval(right if unknown_left else left, env, expr)
    inner = left if unknown_left else right
    if op == "+":
        return _invert(inner, target - known, env, expr)
    if op == "-":
        return _invert(inner, target + known if unknown_left else known - target, env, expr)
    if known == 0 or target % known:  # "*": no int gives it
        return None
    return _invert(inner, target // known, env, expr)


def determined(dims_lists, known) -> set:
    """The names the dimensions determine, starting from ``known`` (scalars, given
    generics): every bare name, then, until nothing changes, the one unknown name
    of an expression that is solvable for it (the module docstring's rule)."""
    known = set(known)
    exprs = []
    for dims in dims_lists:
        for d in dims:
            if isinstance(d, str):
                known.add(d)
            elif isinstance(d, Expr):
                exprs.append(d)
    changed = True
    while changed:
        changed = False
        for e in exprs:
            unknown = [n for n in e.names if n not in known]
            if len(unknown) == 1 and e.solvable_for(unknown[0]):
                known.add(unknown[0])
                changed = True
    return known


def dim_names(d) -> tuple:
    """The names a dimension reads (none for an int)."""
    return (d,) if isinstance(d, str) else d.names if isinstance(d, Expr) else ()
