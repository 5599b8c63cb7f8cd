"""The tools around the model: checkpoint averaging and recovery, evaluation, plots and
analyses, the quality study and the demo. Each command-line tool is a module with a
``main`` and a console script (``tpp-...``; see setup.cfg)."""
