"""Chapter 00 — the tour's headline experiments, one module per chapter (chNN_slug: chapter NN's rows).

``chNN_<slug>.headline(smoke=False)`` runs chapter NN's experiment (it launches its own ranks)
and returns the tour's rows ``{"chapter", "experiment", "theory", "measured", "ok"}``; the
registry names each one (``Chapter.headline``) and ``python -m minitorch_dist tour`` prints them.
The library modules hold the techniques; these modules only put them to the test.
"""
