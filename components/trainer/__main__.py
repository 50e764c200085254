import sys

from components.trainer.entry import main

sys.exit(main())
