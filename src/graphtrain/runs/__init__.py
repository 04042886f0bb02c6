"""Operations on finished or running runs: ``graphtrain plot`` (plot.py, plot_page.py), ``graphtrain sweep``
(sweep.py) and ``graphtrain export`` (export.py)."""
