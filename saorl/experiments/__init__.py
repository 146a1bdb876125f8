"""Experiments: compare algorithms or ablations arm × seed under one budget, then tabulate and plot.

``spec`` (the YAML model), ``runner`` (runs every arm × seed via ``saorl.training.train``,
resumably), ``report`` (Markdown table and PNG plots), ``cli`` (``saorl experiment``).
"""
