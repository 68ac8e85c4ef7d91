package main

import (
	"context"
	"flag"
	"fmt"
	"net/url"
	"os"

	"go.etcd.io/etcd/server/v3/embed"
)

// runEtcd serves one etcd member with no peers, on the client address and data directory the
// caller names, until ctx ends; etcd's own command line brings a second copy of its
// dependencies, so the member is embedded instead.
func runEtcd(ctx context.Context, args []string) int {
	flags := flag.NewFlagSet("etcd", flag.ContinueOnError)
	dataDir := flags.String("data-dir", "", "where the member keeps its data")
	clientURL := flags.String("listen-client-url", "", "http://127.0.0.1:PORT")
	peerURL := flags.String("listen-peer-url", "", "http://127.0.0.1:PORT")
	if err := flags.Parse(args); err != nil {
		return 2
	}
	config := embed.NewConfig()
	config.Dir = *dataDir
	config.LogLevel = "warn"
	client, err := url.Parse(*clientURL)
	if err != nil {
		fmt.Fprintln(os.Stderr, "etcd:", err)
		return 2
	}
	peer, err := url.Parse(*peerURL)
	if err != nil {
		fmt.Fprintln(os.Stderr, "etcd:", err)
		return 2
	}
	config.ListenClientUrls = []url.URL{*client}
	config.AdvertiseClientUrls = []url.URL{*client}
	config.ListenPeerUrls = []url.URL{*peer}
	config.AdvertisePeerUrls = []url.URL{*peer}
	config.InitialCluster = config.Name + "=" + peer.String()
	server, err := embed.StartEtcd(config)
	if err != nil {
		fmt.Fprintln(os.Stderr, "etcd:", err)
		return 1
	}
	defer server.Close()
	select {
	case <-server.Server.ReadyNotify():
		fmt.Fprintln(os.Stderr, "etcd: ready")
	case err := <-server.Err():
		fmt.Fprintln(os.Stderr, "etcd:", err)
		return 1
	}
	select {
	case <-ctx.Done():
		return 0
	case err := <-server.Err():
		fmt.Fprintln(os.Stderr, "etcd:", err)
		return 1
	}
}
