"""Adapters that bring gpipe's pipeline into the trainers users already work in.

Each adapter lives in its own module and imports its trainer only when that module is
imported (``gpipe.integrations.lightning`` needs ``lightning``), so importing this package
costs nothing.
"""
