from collm.edge_client.cli import main

main()
