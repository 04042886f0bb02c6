"""`python -m graphtrain.bench SUITE ...`: the same as `graphtrain bench SUITE ...`."""

from graphtrain.bench.cli import main

raise SystemExit(main())
