import sys

from components.reward_server.entry import main

sys.exit(main())
