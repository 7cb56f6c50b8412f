"""The research built on geoopt-stiefel-attention: the studies that motivate the method and their records.

Not part of the installed package: run from a checkout of the repository, ``python -m experiments <study>``
(``grokking``, ``vision``, ``lm``; ``--help`` for each study's flags). The package never imports this one.

- :mod:`experiments.harness`: what every study shares: configs, the arms, the one training loop and runner,
  records, summaries, paired statistics, figures and the markdown report, and the study command's base class
  (:class:`experiments.harness.command.StudyCommand`);
- :mod:`experiments.grokking`, :mod:`experiments.vision`, :mod:`experiments.lm`: one folder per study with its
  code (``study.py``: config, task, arms, command; ``data.py``: its data set), its configs and run scripts, its
  README and its committed records (``records/<name>/``: ``report.md``, ``summary.json``, figures and the runs'
  ``runs/<arm>/seed<k>/`` records, from which ``--report-only`` rebuilds the report).
"""
