"""moetrain's tests, a package: helpers are imported as ``tests.helpers...``.

Every folder of tests has an ``__init__.py``, so pytest (its default "prepend" import mode)
imports test modules by their package name (``tests.unit.test_cli``) and puts the folder above
the outermost package, the repository root, on ``sys.path``: ``import tests`` then finds this
folder, in pytest and in the rank processes that multiprocessing spawns (they get the parent's
``sys.path`` and import job functions by module name, e.g. ``tests.distributed.parity_jobs``),
with no ``sys.path`` changes in the tests. Regular packages rather than ``pythonpath = ["."]`` in
pyproject.toml: a namespace package ``tests`` would lose to any installed package of that name.
"""
