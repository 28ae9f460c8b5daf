"""Result files and what reads them: the schema per kind (``models.py``), writing and loading
(``files.py``), the environment a run records, statistics, the regression gate and the
report."""
