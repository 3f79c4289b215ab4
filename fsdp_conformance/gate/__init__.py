"""The upgrade gate: run the suite (``suite``), write and read reports (``report``), compare two
reports (``compare``) and draw their memory timelines (``plots``).

Import the modules themselves: this package re-exports nothing.
"""
