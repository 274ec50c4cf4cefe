"""The Python API is documented, and the book's page of it is the one its docstrings write.

Every public item (what ``cellc.__all__`` names, the public methods and properties of its
classes, the exceptions, the custom operators) has a docstring of its own; every argument is
named under its ``Args:``, and nothing that is not an argument is; every function that returns
something says what under ``Returns:``; the examples in docstrings run (doctest); and
``docs/src/reference/python-api.md`` is what ``docs/gen_python_api.py`` writes now. The walk
over the API is the generator's own, so the page and these checks see the same items.
"""

import doctest
import importlib.util
import inspect
import sys
from pathlib import Path

import pytest

import cellc

ROOT = Path(__file__).resolve().parents[3]
GENERATOR = ROOT / "docs" / "gen_python_api.py"


def _load_generator():
    spec = importlib.util.spec_from_file_location("gen_python_api", GENERATOR)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


gen = _load_generator()
ITEMS = [item for item in gen.public_items() if item.kind != "heading"]
FUNCTIONS = [item for item in ITEMS if item.func is not None]


def _ids(items):
    return [item.title for item in items]


def test_the_walk_finds_the_whole_api():
    titles = {item.title for item in ITEMS}
    for name in cellc.__all__:
        obj = getattr(cellc, name)
        if inspect.isclass(obj) or inspect.ismodule(obj) or callable(obj):
            assert f"cellc.{name}" in titles
    for method in ("forward", "reset_parameters", "dropout_masks", "cell_masks", "all_weights"):
        assert f"RNN.{method}" in titles
    assert {"torch.ops.cellc.rnn_forward", "torch.ops.cellc.rnn_backward"} <= titles


@pytest.mark.parametrize("item", ITEMS, ids=_ids(ITEMS))
def test_every_public_item_has_a_docstring(item):
    assert gen.docstring(item.obj).strip(), f"{item.title} has no docstring of its own"


@pytest.mark.parametrize("item", FUNCTIONS, ids=_ids(FUNCTIONS))
def test_every_argument_is_named_under_args(item):
    doc = gen.docstring(item.obj)
    documented = gen.documented_names(doc)
    params = gen.parameters(item.func)
    wanted = {p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    missing = sorted(wanted - documented)
    assert not missing, f"{item.title}: arguments not named under Args: {missing}"
    # Nothing documented that is not an argument (a renamed or removed one).
    spelled = {("*" if p.kind is p.VAR_POSITIONAL else "**" if p.kind is p.VAR_KEYWORD else "") + p.name
               for p in params}
    stale = sorted(documented - spelled)
    assert not stale, f"{item.title}: Args names what is not an argument: {stale}"


@pytest.mark.parametrize("item", FUNCTIONS, ids=_ids(FUNCTIONS))
def test_every_result_is_described(item):
    if item.kind == "class":
        return  # a constructor returns its object
    # A Rust function has no annotation; every one the package exports returns something.
    if not inspect.isbuiltin(item.func) and inspect.signature(item.func).return_annotation in ("None", None):
        return
    names = [name for name, _ in gen.sections(gen.docstring(item.obj))]
    assert "Returns" in names, f"{item.title} returns something but its docstring has no Returns: section"


def test_module_attributes_are_documented():
    documented = gen.documented_names(gen.docstring(cellc), "Attributes")
    for name in cellc.__all__:
        obj = getattr(cellc, name)
        if not (inspect.isclass(obj) or inspect.ismodule(obj) or callable(obj)):
            assert name in documented, f"cellc.{name} is not under the module docstring's Attributes:"


def test_class_attributes_are_documented():
    rnn = cellc.RNN("lstm", 4, 8)
    documented = gen.documented_names(gen.docstring(cellc.RNN), "Attributes")
    public = {name for name in vars(rnn) if not name.startswith("_") and name != "training"}
    assert public - documented == set(), f"RNN attributes without docs: {sorted(public - documented)}"
    assert documented - public == set(), f"RNN documents attributes it lacks: {sorted(documented - public)}"


EXAMPLES = [item for item in ITEMS if ">>>" in gen.docstring(item.obj)]


@pytest.mark.parametrize("item", EXAMPLES, ids=_ids(EXAMPLES))
def test_docstring_examples_run(item):
    test = doctest.DocTestParser().get_doctest(gen.docstring(item.obj), {}, item.title, None, 0)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    runner.run(test)
    assert runner.failures == 0, f"the example of {item.title} fails (its report is above)"


def test_the_api_page_is_up_to_date():
    want = gen.page()
    have = gen.PAGE.read_text(encoding="utf-8") if gen.PAGE.is_file() else ""
    assert have == want, "docs/src/reference/python-api.md is stale: run python docs/gen_python_api.py"
