"""What a Hugging Face causal LM's forward does between its head and its loss, read from the installed source.

memtrain's chunked loss replaces a causal LM's forward with Llama's, the loss computed a chunk at a time
(``memtrain.loss``): decoder -> ``lm_head`` on the last hidden state -> ``self.loss_function``. That is exact for
every model whose forward *is* Llama's, statement for statement, except for steps on the logits between the head
and the loss that a chunk can apply to its own logits: a multiplication or division by an attribute of the model
or its config (Cohere's ``logit_scale``, Granite's ``logits_scaling``) and Gemma-2's soft-capping
(``tanh(logits / cap) * cap``, skipped where the cap is None). ``logit_steps(cls)`` checks this on the class's
forward as the installed transformers writes it, so a model type is known by what its code does, not by a list
kept by hand, and an edit in a later transformers (a router loss added, the head's input changed) is a refusal,
not a wrong loss.

Compared with Llama's forward after: dropping the docstring, reading ``x: T = v`` as ``x = v``, taking the steps
out, and writing the loss call's arguments one way (``self.loss_function(logits, labels, self.vocab_size, **kwargs)``
and the keyword form are one call). GPT-2's forward is another shape (``self.transformer``, cross-attentions)
checked by hand (``OWN_FORWARDS``).

Example:
    >>> from transformers import CohereForCausalLM
    >>> logit_steps(CohereForCausalLM)
    (('multiply', 'logit_scale'),)
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from pathlib import Path
from typing import Literal

LogitOp = Literal["multiply", "divide", "softcap"]
Steps = tuple[tuple[LogitOp, str], ...]

# Classes whose forward is not Llama's but whose head and loss memtrain's chunked forward reproduces, checked by
# hand against transformers 5.25 (parity: tests/test_loss.py): taken only with that class's own forward.
OWN_FORWARDS: dict[str, Steps] = {"GPT2LMHeadModel": ()}


class Unrecognised(str):
    """Why a forward is not one ``logit_steps`` knows: the first statement that differs from Llama's."""


def logit_steps(cls: type) -> Steps | Unrecognised:
    """The steps ``cls.forward`` takes on its logits between ``self.lm_head`` and ``self.loss_function``, in order,
    as (op, the attribute path it reads from the model), where the forward is otherwise Llama's; an
    ``Unrecognised`` saying where it is not."""
    import transformers

    own = next((name for name in OWN_FORWARDS if cls.forward is getattr(transformers, name).forward), None)
    if own is not None:
        return OWN_FORWARDS[own]
    if getattr(cls, "base_model_prefix", None) != "model":  # Llama's forward calls its decoder at self.model
        return Unrecognised(f"{cls.__name__}'s decoder is at .{getattr(cls, 'base_model_prefix', None)}, not at "
                            ".model as in Llama's forward")
    return _steps_of(cls.forward)


@functools.cache
def _steps_of(forward: object) -> Steps | Unrecognised:
    from transformers import LlamaForCausalLM

    reference = _normalised(LlamaForCausalLM.forward)
    if isinstance(reference, Unrecognised):  # a transformers whose Llama memtrain cannot read: nothing is known
        return Unrecognised(f"Llama's own forward is not one memtrain reads ({reference})")
    found = _normalised(forward)
    if isinstance(found, Unrecognised):
        return found
    (body, steps, where), (want, _, _) = found, reference
    for i, statement in enumerate(body):
        if i >= len(want) or ast.dump(statement) != ast.dump(want[i]):
            return Unrecognised(f"{where(statement)} differs from Llama's forward")
    if len(body) != len(want):
        return Unrecognised(f"it ends where Llama's forward goes on ({ast.unparse(want[len(body)]).splitlines()[0]})")
    return steps


def _normalised(forward: object) -> tuple[list[ast.stmt], Steps, object] | Unrecognised:
    """The forward's statements with the logits' steps taken out and the loss call in one form, its steps, and a
    function naming a statement's line in its file."""
    function = _unwrapped(forward)
    if isinstance(function, Unrecognised):
        return function
    try:
        lines, first = inspect.getsourcelines(function)
    except (OSError, TypeError):
        return Unrecognised(f"the source of {getattr(function, '__qualname__', function)} cannot be read")
    tree = ast.parse(textwrap.dedent("".join(lines)))
    if not tree.body or not isinstance(tree.body[0], (ast.FunctionDef, ast.AsyncFunctionDef)):
        return Unrecognised(f"{getattr(function, '__qualname__', function)} is not a function")
    path = inspect.getsourcefile(function) or "?"

    def where(statement: ast.stmt) -> str:
        text = ast.unparse(statement).splitlines()[0]
        return f"{path}:{first + statement.lineno - 1} ({text})"

    body = [_plain_assign(s) for s in tree.body[0].body]
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    steps: list[tuple[LogitOp, str]] = []
    out: list[ast.stmt] = []
    head_seen = False
    for statement in body:
        value = _logits_value(statement)
        if not head_seen and value is not None and _head_call(_operand(value)):
            head_seen = True
            step = _step(value, _head_call)
            if step is not None:  # logits = self.lm_head(h) * self.x
                steps.append(step)
                statement = ast.Assign(targets=statement.targets, value=value.left, lineno=statement.lineno)
        elif head_seen and not _loss_started(statement):
            step = _step(value, _is_logits) if value is not None else _softcap(statement)
            if step is None:
                return Unrecognised(f"{where(statement)} does to the logits what memtrain does not know")
            steps.append(step)
            continue
        out.append(_loss_call_normalised(statement))
        if head_seen and _loss_started(statement):
            head_seen = False
    return out, tuple(steps), where


def _unwrapped(forward: object) -> object:
    """The function under the decorators ``forward`` wears: transformers' own (``can_return_tuple``, which may
    change how the output is returned, not what the loss is), read through; a wrapper defined elsewhere (a user's
    ``functools.wraps`` decorator, which may change the loss) is Unrecognised, naming its file and line."""
    import transformers

    package = Path(transformers.__file__).resolve().parent
    function = forward
    while hasattr(function, "__wrapped__"):
        code = getattr(function, "__code__", None)
        if code is None or not Path(code.co_filename).resolve().is_relative_to(package):
            where = f"{code.co_filename}:{code.co_firstlineno}" if code is not None else repr(function)
            name = getattr(code, "co_qualname", getattr(code, "co_name", "?"))
            return Unrecognised(f"the forward is wrapped by {name} ({where}), a decorator from outside transformers "
                                "that memtrain does not read through")
        function = function.__wrapped__
    return function


def _plain_assign(statement: ast.stmt) -> ast.stmt:
    """``x: T = v`` as ``x = v`` (an annotation changes nothing the forward does)."""
    if isinstance(statement, ast.AnnAssign) and statement.value is not None and statement.simple:
        return ast.Assign(targets=[statement.target], value=statement.value, lineno=statement.lineno)
    return statement


def _attribute_path(node: ast.expr) -> str | None:
    """``self.a.b`` as "a.b"; None for anything else."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join(reversed(parts)) if isinstance(node, ast.Name) and node.id == "self" and parts else None


def _is_logits(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id == "logits"


def _head_call(node: ast.expr) -> bool:
    return isinstance(node, ast.Call) and _attribute_path(node.func) == "lm_head"


def _operand(node: ast.expr) -> ast.expr:
    return node.left if isinstance(node, ast.BinOp) else node


def _logits_value(statement: ast.stmt) -> ast.expr | None:
    """``v`` of ``logits = v``."""
    if isinstance(statement, ast.Assign) and len(statement.targets) == 1 and _is_logits(statement.targets[0]):
        return statement.value
    return None


def _step(value: ast.expr | None, left: object) -> tuple[LogitOp, str] | None:
    """("multiply" / "divide", "path") for ``left * self.path`` / ``left / self.path``."""
    if (isinstance(value, ast.BinOp) and isinstance(value.op, (ast.Mult, ast.Div))
            and left(value.left)):  # type: ignore[operator]
        source = _attribute_path(value.right)
        if source is not None:
            return ("multiply" if isinstance(value.op, ast.Mult) else "divide"), source
    return None


def _softcap(statement: ast.stmt) -> tuple[LogitOp, str] | None:
    """("softcap", "path") for Gemma-2's ``if self.path is not None: logits = logits / self.path; logits =
    torch.tanh(logits); logits = logits * self.path``."""
    test = getattr(statement, "test", None)
    if not (isinstance(statement, ast.If) and not statement.orelse and len(statement.body) == 3
            and isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.IsNot)
            and isinstance(test.comparators[0], ast.Constant) and test.comparators[0].value is None):
        return None
    cap = _attribute_path(test.left)
    divide, tanh, multiply = (_logits_value(s) for s in statement.body)
    if (cap is not None and _step(divide, _is_logits) == ("divide", cap)
            and isinstance(tanh, ast.Call) and ast.unparse(tanh.func) == "torch.tanh" and len(tanh.args) == 1
            and _is_logits(tanh.args[0]) and not tanh.keywords and _step(multiply, _is_logits) == ("multiply", cap)):
        return "softcap", cap
    return None


def _loss_started(statement: ast.stmt) -> bool:
    """``loss = None``: where Llama's forward turns from the logits to the loss."""
    return (isinstance(statement, ast.Assign) and len(statement.targets) == 1
            and isinstance(statement.targets[0], ast.Name) and statement.targets[0].id == "loss"
            and isinstance(statement.value, ast.Constant) and statement.value.value is None)


_LOSS_ARGUMENTS = ("logits", "labels", "vocab_size")


def _loss_call_normalised(statement: ast.stmt) -> ast.stmt:
    """``if labels is not None: loss = self.loss_function(...)`` with its arguments as keywords, the vocabulary
    size read as ``self.config.vocab_size`` (``self.vocab_size`` is a copy of it): one form for either spelling."""
    if not (isinstance(statement, ast.If) and len(statement.body) == 1 and isinstance(statement.body[0], ast.Assign)):
        return statement
    call = statement.body[0].value
    if not (isinstance(call, ast.Call) and _attribute_path(call.func) == "loss_function" and len(call.args) <= 3):
        return statement
    keywords = [ast.keyword(arg=name, value=value) for name, value in zip(_LOSS_ARGUMENTS, call.args, strict=False)]
    keywords += call.keywords
    for keyword in keywords:
        if keyword.arg == "vocab_size" and _attribute_path(keyword.value) == "vocab_size":
            keyword.value = ast.Attribute(value=ast.Attribute(value=ast.Name(id="self", ctx=ast.Load()),
                                                              attr="config", ctx=ast.Load()),
                                          attr="vocab_size", ctx=ast.Load())
    named = sorted((k for k in keywords if k.arg is not None), key=lambda k: k.arg or "")
    rest = [k for k in keywords if k.arg is None]
    new_call = ast.Call(func=call.func, args=[], keywords=named + rest)
    assign = ast.Assign(targets=statement.body[0].targets, value=new_call, lineno=statement.body[0].lineno)
    return ast.If(test=statement.test, body=[assign], orelse=statement.orelse, lineno=statement.lineno)
