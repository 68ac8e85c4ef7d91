// Command kubenode hosts the Kubernetes components of kuscale's end-to-end node in one binary:
// etcd, kube-apiserver, kube-scheduler and the kubelet, each run as its own process by naming
// it first, so the tests build one program from the Kubernetes modules and start each part
// with the flags its own documentation gives.
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/spf13/cobra"
	"k8s.io/component-base/cli"
	apiserver "k8s.io/kubernetes/cmd/kube-apiserver/app"
	scheduler "k8s.io/kubernetes/cmd/kube-scheduler/app"
	kubelet "k8s.io/kubernetes/cmd/kubelet/app"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: kubenode etcd|kube-apiserver|kube-scheduler|kubelet [flags]")
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	var command *cobra.Command
	switch os.Args[1] {
	case "etcd":
		os.Exit(runEtcd(ctx, os.Args[2:]))
	case "kube-apiserver":
		command = apiserver.NewAPIServerCommand()
	case "kube-scheduler":
		command = scheduler.NewSchedulerCommand()
	case "kubelet":
		command = kubelet.NewKubeletCommand(ctx)
	default:
		fmt.Fprintf(os.Stderr, "kubenode: no component %q\n", os.Args[1])
		os.Exit(2)
	}
	command.SetArgs(os.Args[2:])
	os.Exit(cli.Run(command))
}
