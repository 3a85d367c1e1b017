"""Messages that keep the arguments they name (``memtrain.message``): read back whatever text surrounds them, kept
through the errors that carry them (pickled between ranks too), never printed with their marks."""

from __future__ import annotations

import copy
import pickle

import pytest

from memtrain.errors import ConfigError, MemtrainError
from memtrain.message import WHATEVER, Arg, Message, Words, arg, marked, words


def test_the_parts_are_the_arguments_and_the_text_between():
    message = Message(f"{arg('out_dir', '/x')} is a file; pass {arg('resume', True)} or {words('a', 'b')}.")
    assert message.parts == (Arg("out_dir", "'/x'"), " is a file; pass ", Arg("resume", "True"), " or ",
                             Words("a", "b"), ".")
    assert message == "out_dir='/x' is a file; pass resume=True or a."
    assert Message(arg("x", WHATEVER)).parts == (Arg("x", ""),) and Message(arg("x")).parts == (Arg("x"),)


@pytest.mark.parametrize("stray", ["\ue000", "\ue003", "\ue000\ue0a0", "\ue000\ue0a3", "\ue001\ue002"])
def test_a_users_text_with_private_use_characters_is_text(stray):
    path = f"/data/notes{stray}.txt"
    message = Message(f"{path}: not UTF-8. To resolve this error, pass {arg('path', 'x')}.")
    assert str(message).startswith(path) or stray in ("\ue000\ue0a0",), repr(message)
    assert Message(f"{path} only") == f"{path} only"  # no mark: the text as it is


def test_a_value_is_written_by_repr_so_it_cannot_close_a_mark():
    message = Message(f"{arg('out_dir', 'a' + chr(0xE000) + chr(0xE0A3) + 'b')} is a file")
    assert message.parts[0].name == "out_dir" and message.parts[1] == " is a file"


def test_errors_keep_their_messages_through_pickle_and_copy():
    error = ConfigError([f"{arg('seed', -1)} is negative", f"{arg('lr', text='3e-3')} too"])
    for again in (pickle.loads(pickle.dumps(error)), copy.deepcopy(error)):
        assert str(again) == str(error)
    assert [p.parts[0] for p in error.problems] == [Arg("seed", "-1"), Arg("lr", "3e-3")]
    joined = ConfigError([marked(p) for p in error.problems])  # another rank's error, from the marked problems
    assert joined.problems == error.problems and joined.problems[0].parts == error.problems[0].parts
    assert MemtrainError(3).message == "3" and MemtrainError().message == ""
    assert "\ue000" not in str(error) and "\ue000" not in repr(error)
