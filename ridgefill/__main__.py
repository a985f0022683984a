from ridgefill.cli import main

main()
