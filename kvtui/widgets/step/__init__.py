"""The step viewer's panes (kvtui's chat, a watched program or process tree, a trace): the chat, the token
buffer, the cursor, the top-k, the layers, the alarms, the requests of a packed batch, the attention strip."""
