from graphtrain.cli import main

raise SystemExit(main())
