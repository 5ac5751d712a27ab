from ft.cli.app import main

main()
