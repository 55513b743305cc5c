import sys

from pd.cli.main import main

sys.exit(main())
