"""Repository-level pytest configuration.

The suite's own plugin (fixtures, markers, options) is registered through the package's
``pytest11`` entry point, and ``pytester`` through ``-p pytester`` in pyproject's addopts, so
this file declares no plugins and no fixtures: it is also loaded when ``--fsdp-model`` collects
the checks from an editable install of this repository. A test that runs the suite in process
hands it the session's warm pools (the plugin's ``rank_pools``) as its engine
(``suite.run_suite(plan, rank_pools)``); an inner pytest session borrows them through its
harness session (``HarnessSession.pools = rank_pools``, which that session leaves warm).
"""
