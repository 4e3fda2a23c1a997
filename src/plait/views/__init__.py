"""Presentation: every table, bar and plot a command prints or draws.

Commands compute plain dicts and lists (reports, rows, schedules); the modules
here turn them into rich tables on the console and matplotlib figures, with
one set of helpers (`common`) for consoles and sizes.
"""
