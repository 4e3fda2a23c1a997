from plait.cli import entry

entry()
