"""Repository-level pytest configuration.

The suite's own plugin (fixtures, markers, options) is registered through the package's
``pytest11`` entry point, and ``pytester`` through ``-p pytester`` in pyproject's addopts, so
this file declares no plugins: it is also loaded when ``--fsdp-model`` collects the checks from
an editable install of this repository.
"""
