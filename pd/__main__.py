import sys

from pd.cli import main

sys.exit(main())
