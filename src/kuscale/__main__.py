from kuscale.cli import main

raise SystemExit(main())
